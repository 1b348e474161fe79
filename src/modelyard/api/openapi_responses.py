"""Response schemas of the OpenAI-compatible routes, for the served OpenAPI document only.

The handlers return plain dicts (or relay a worker's bytes), so these models validate nothing at
run time; they say what a client gets, and the schemathesis suite checks every answer against
them. Only the fields clients rely on are required; others may be added.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class ModelObject(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    endpoint_id: str
    kind: Literal["chat", "completion", "embedding", "classifier"] | None = Field(
        description="Which routes the model answers; null while its endpoint is provisioning."
    )
    capabilities: dict[str, Any] = Field(
        description="tools, structured_outputs, reasoning, adapters (LLMs) and max_context."
    )
    sampling_defaults: dict[str, float] = Field(
        description="Filled into chat and completion requests that leave these fields out."
    )
    parent: str | None = Field(
        None, description="A registry LoRA adapter's base model (absent for a model itself)."
    )


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelObject]


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    has_more: bool


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class EmbeddingObject(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingObject]
    model: str
    usage: EmbeddingUsage


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseObject(BaseModel):
    """`/v1/responses`: output items are `message` and `function_call` objects."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None


class Health(BaseModel):
    status: str


# One server-sent event: a JSON chunk (or the final `[DONE]`) in `data`.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}


def ok(model: type[BaseModel], stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route whose 200 is `model` (or, when asked, a server-sent stream)."""
    response: dict[str, Any] = {"model": model}
    if stream:
        response["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
    return {200: response}
