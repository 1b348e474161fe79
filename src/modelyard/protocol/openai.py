"""Request schemas of the OpenAI API (chat completions, completions), validated by pydantic.

Unknown fields are ignored, as OpenAI's own server does, except those that ask for a feature
this server does not have (tools, response_format, logit_bias…): those get a clear 400.
Extra knobs that vLLM users expect (top_k, min_p, repetition_penalty, stop_token_ids,
ignore_eos, priority, cache_salt) are accepted as well.

Every text field must be encodable as UTF-8: JSON can spell a lone surrogate (`"\udcff"`),
which no tokenizer takes, so it is refused here with the field's name. Ranges that depend on
the model (top_k and token ids against the vocabulary, lengths against the context) are checked
by the engine's admission (`modelyard.engine.admission`), at the worker.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# A worker's stream says how many prompt tokens it holds, so a metering proxy can bill the
# prompt of a stream whose client goes away before the final usage chunk.
PROMPT_TOKENS_HEADER = "x-modelyard-prompt-tokens"
# A cache salt is an opaque namespace name, hashed once per request: no need for more.
MAX_CACHE_SALT_CHARS = 256


def _check_text(value: str, where: str) -> str:
    """Refuse text that cannot be encoded (a lone surrogate): tokenizers raise on it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where} is not valid Unicode text: it holds a lone surrogate "
            f"(U+{ord(value[exc.start]):04X}) at index {exc.start}"
        ) from None
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_is_text(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        if isinstance(value, str):
            _check_text(value, "content")
        elif value is not None:
            for i, part in enumerate(value):
                _check_text(part.text, f"content[{i}].text")
        return value

    @field_validator("name")
    @classmethod
    def _name_is_text(cls, value: str | None) -> str | None:
        return None if value is None else _check_text(value, "name")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # Beyond OpenAI, as in vLLM.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=0, le=9, description="0 interactive (first), higher is later.")
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="Prefix-cache namespace: only requests with the same salt share cached "
        "prompt blocks. Behind the gateway it is always the tenant's (a client's is replaced).",
    )
    # Accepted by OpenAI, not implemented here: a non-default value is rejected.
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if isinstance(value, str):
            value = [value]
        for i, stop in enumerate(value or ()):
            _check_text(stop, f"stop[{i}]")
        return value

    @field_validator("model", "user", "cache_salt")
    @classmethod
    def _is_text(cls, value: str | None) -> str | None:
        return None if value is None else _check_text(value, "the value")

    def stop_list(self) -> tuple[str, ...]:
        return tuple(self.stop or ())  # type: ignore[arg-type]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format"
        if self.logit_bias:
            return "logit_bias"
        return None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_is_text(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(value, str):
            _check_text(value, "prompt")
        else:
            for i, item in enumerate(value):
                if isinstance(item, str):
                    _check_text(item, f"prompt[{i}]")
        return value

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.echo:
            return "echo"
        if self.logit_bias:
            return "logit_bias"
        return None
