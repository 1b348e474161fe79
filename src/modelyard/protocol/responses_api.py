"""Request schema of OpenAI's Responses API (`POST /v1/responses`), the stateless subset.

Honoured: `input` (a string, or items: messages with text parts, `function_call`,
`function_call_output`), `instructions`, function `tools`, `tool_choice`,
`parallel_tool_calls`, `text.format` (text, json_object, json_schema), `max_output_tokens`,
`temperature`, `top_p`, `stream`, and the vLLM-style sampling extras chat takes. This server
keeps no state: `previous_response_id`, `conversation`, `store: true` and `background: true`
are refused with a 400 naming them (nothing is stored, so nothing could be continued or
fetched later); a request that leaves `store` out is simply not stored. Other fields that ask
for something not offered (built-in tools, reasoning, includes, prompt templates) are refused
by name too; unknown arguments get OpenAI's "Unrecognized request argument supplied".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from modelyard.protocol.bounds import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_TEXT_CHARS,
    MAX_TOKEN_ID,
    EchoedList,
    JSONObject,
    Name,
    Text,
    TokenCount,
    Word,
    at_most,
)
from modelyard.protocol.openai import MAX_CACHE_SALT_CHARS, StreamOptions, StrictRequest, refused
from modelyard.protocol.structured import JSONSchemaSpec
from modelyard.protocol.tools import MAX_TOOLS, NAME_PATTERN, check_parameters


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text", "text"]
    text: Text
    annotations: EchoedList | None = None  # output-only, echoed back by clients: ignored
    logprobs: EchoedList | None = None  # idem


class Refusal(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["refusal"]
    refusal: Text


Part = Annotated[InputText | Refusal, Field(discriminator="type")]


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: Name | None = None
    status: Word | None = None

    @field_validator("content")
    @classmethod
    def _bounded(cls, value: str | list[Part]) -> str | list[Part]:
        if isinstance(value, str):
            return at_most(value, MAX_TEXT_CHARS)
        return at_most(value, MAX_CONTENT_PARTS, "content parts")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, InputText) else p.refusal for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: Name
    arguments: Text
    id: Name | None = None
    status: Word | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Text
    id: Name | None = None
    status: Word | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(BaseModel):
    """A function tool as the Responses API writes it (flat: no nested `function`)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_parameters(value)


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)


class TextFormatText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class TextFormatJSONObject(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_object"]


class TextFormatJSONSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    schema_: JSONObject = Field(alias="schema")
    strict: StrictBool | None = None

    def spec(self) -> JSONSchemaSpec:
        return JSONSchemaSpec(
            name=self.name, description=self.description, schema_=self.schema_, strict=self.strict
        )


TextFormat = Annotated[
    TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")
]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Word | None = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, value: str | None) -> str | None:
        if value is not None:
            raise refused("verbosity is not supported with this model")
        return value


ITEM_TYPES = ("message", "function_call", "function_call_output")
PART_TYPES = ("input_text", "output_text", "text", "refusal")


def _only(what: str, kind: Any) -> PydanticCustomError:
    return PydanticCustomError(
        "unsupported", "only {what} are supported here, not '{kind}'",
        {"what": what, "kind": str(kind)[:64]},
    )  # fmt: skip


def _check_kinds(data: dict[str, Any]) -> None:
    """Refuse by their type what this server does not offer: built-in tools (web search,
    file search…), input items other than messages and function calls (reasoning, item
    references), content other than text (images, files, audio)."""
    for tool in data.get("tools") or () if isinstance(data.get("tools"), list) else ():
        if isinstance(tool, dict) and tool.get("type") != "function":
            raise _only("function tools", tool.get("type"))
    items = data.get("input")
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict):
            continue
        if item.get("type", "message") not in ITEM_TYPES:
            raise _only("message, function_call and function_call_output input items",
                        item.get("type"))  # fmt: skip
        content = item.get("content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") not in PART_TYPES:
                raise _only("text content parts", part.get("type"))


class ResponsesRequest(StrictRequest):
    model: Name = Field(min_length=1)
    input: str | list[InputItem]
    instructions: Text | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: TokenCount | None = None
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Accepted, no effect on the answer (abuse monitoring, cache routing).
    user: Name | None = None
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None
    service_tier: Word | None = None
    truncation: Literal["disabled"] | None = None
    # Stateless: refused unless they ask for nothing.
    store: StrictBool | None = None
    previous_response_id: Name | None = None
    conversation: Any = None
    background: StrictBool | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    include: Annotated[list[Name], Field(max_length=64)] | None = None
    reasoning: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: StrictInt | None = None
    top_logprobs: StrictInt | None = None
    prompt_cache_retention: Word | None = None
    # Beyond OpenAI, as on chat (endpoint sampling defaults arrive as these).
    top_k: StrictInt | None = Field(None, ge=-1, le=MAX_TOKEN_ID)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0, le=100.0)
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    priority: StrictInt = Field(0, ge=0, le=9)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @model_validator(mode="before")
    @classmethod
    def _offered_kinds_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_kinds(data)
        return data

    @field_validator("input")
    @classmethod
    def _bounded_input(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if isinstance(value, str):
            return at_most(value, MAX_TEXT_CHARS)
        return at_most(value, MAX_MESSAGES, "input items")

    @field_validator("store")
    @classmethod
    def _not_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise refused("this server is stateless: responses are not stored; set store false")
        return value

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _no_state(cls, value: Any) -> Any:
        if value is not None:
            raise refused(
                "this server is stateless: send the whole conversation as input items instead"
            )
        return value

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool | None) -> bool | None:
        if value:
            raise refused("background responses are not supported (they would be stored)")
        return value

    @field_validator("metadata")
    @classmethod
    def _no_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value:
            raise refused("metadata is kept with stored responses; responses are not stored")
        return value

    @field_validator("include")
    @classmethod
    def _no_include(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise refused(f"{value[0]!r} cannot be included: no such output here")
        return value

    @field_validator("reasoning", "prompt", "max_tool_calls", "top_logprobs")
    @classmethod
    def _not_offered(cls, value: Any) -> Any:
        if value is not None:
            raise refused("this parameter is not supported by this server")
        return value

    @field_validator("prompt_cache_retention")
    @classmethod
    def _no_retention(cls, value: str | None) -> str | None:
        if value is not None:
            raise refused("this parameter is not supported by this server")
        return value

    @field_validator("service_tier")
    @classmethod
    def _default_tier(cls, value: str | None) -> str | None:
        if value not in (None, "auto", "default"):
            raise refused("only the 'auto' and 'default' service tiers are offered")
        return value

    # What the gateway's admission reads of any inference request.
    @property
    def max_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def n(self) -> int:
        return 1
