"""Request schemas of the OpenAI API (chat completions, completions), validated by pydantic.

No field is dropped silently (the table is in docs/api.md): every OpenAI field is either
honoured, refused with a 400 naming it when it asks for something this server does not do
(`audio`, `prediction`, `reasoning_effort`, `store: true`…), or accepted and ignored where
that changes nothing a client can observe (`user`, `safety_identifier`, `prompt_cache_key`).
An argument OpenAI does not know either gets OpenAI's own answer, a 400 "Unrecognized request
argument supplied: X". Extra knobs that vLLM users expect (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, skip_special_tokens, priority, cache_salt, guided_*) are accepted.

Every text field must be encodable as UTF-8: JSON can spell a lone surrogate (`"\udcff"`),
which no tokenizer takes, so it is refused here with the field's name. Ranges that depend on
the model (top_k and token ids against the vocabulary, lengths against the context) are checked
by the engine's admission (`modelyard.engine.request_checks`), at the worker.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

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
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MAX_TEXT_CHARS,
    MAX_TOKEN_ID,
    MAX_TOOL_CALLS,
    EchoedList,
    Name,
    Text,
    TokenCount,
    TokenId,
    Word,
    at_most,
    check_token_ids,
)
from modelyard.protocol.structured import StructuredFields
from modelyard.protocol.tools import FunctionCall, ToolCall, ToolFields

# A worker's stream says how many prompt tokens it holds, so a metering proxy can bill the
# prompt of a stream whose client goes away before the final usage chunk.
PROMPT_TOKENS_HEADER = "x-modelyard-prompt-tokens"
# A cache salt is an opaque namespace name, hashed once per request: no need for more.
MAX_CACHE_SALT_CHARS = 256


MAX_LOGIT_BIAS_TOKENS = 300  # as OpenAI
# Prompts of one completions request (each a sequence of its own).
MAX_PROMPTS = 64


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


def refused(message: str) -> PydanticCustomError:
    """A known field this server cannot honour: the 400 names the field (its location)."""
    return PydanticCustomError("unsupported", message)


class StrictRequest(BaseModel):
    """A request body whose unknown top-level arguments get OpenAI's own 400 (the message
    names the argument; OpenAI's `param` is null for it too)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_arguments(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = cls.model_fields
            for key in data:
                if key not in known:
                    raise PydanticCustomError(
                        "unrecognized_argument",
                        "Unrecognized request argument supplied: {name}",
                        {"name": str(key)[:256]},
                    )
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    # Ignored: obfuscation pads events against length side channels; these streams do not pad.
    include_obfuscation: StrictBool | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class RefusalPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["refusal"]
    refusal: Text


ContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One message of the history. Assistant `tool_calls` / `function_call` and `tool` (or
    legacy `function`) results are rendered into the prompt (`modelyard.worker.tools`)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Name | None = None
    function_call: FunctionCall | None = None
    refusal: Text | None = None
    # A reasoning model's thinking of an earlier turn: its chat template may render it again.
    reasoning_content: Text | None = None
    # Output-only fields an SDK may echo back with an assistant message: null or ignored.
    annotations: EchoedList | None = None
    audio: dict[str, Any] | None = None

    @field_validator("content")
    @classmethod
    def _content_is_text(
        cls, value: str | list[ContentPart] | None
    ) -> str | list[ContentPart] | None:
        if isinstance(value, str):
            at_most(value, MAX_TEXT_CHARS)
            _check_text(value, "content")
        elif value is not None:
            at_most(value, MAX_CONTENT_PARTS, "content parts")
            for i, part in enumerate(value):
                text = part.text if isinstance(part, TextPart) else part.refusal
                _check_text(text, f"content[{i}]")
        return value

    @field_validator("name", "tool_call_id", "refusal", "reasoning_content")
    @classmethod
    def _name_is_text(cls, value: str | None) -> str | None:
        return None if value is None else _check_text(value, "the value")

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise refused("audio in messages is not supported by this server (text only)")
        return value

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError(
                "missing_tool_call_id", "a message with role 'tool' needs a 'tool_call_id'"
            )
        if self.role != "assistant" and (self.tool_calls or self.function_call):
            raise PydanticCustomError(
                "tool_calls_role", "only assistant messages may carry tool_calls"
            )
        return self

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)


class SamplingFields(StructuredFields, StrictRequest):
    model: Name = Field(min_length=1)
    n: StrictInt = Field(1, ge=1, le=128)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(
        None, description=f"At most {MAX_STOP_SEQUENCES} strings of {MAX_STOP_CHARS} characters."
    )
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    # Accepted, not used for generation (OpenAI uses it for abuse monitoring only).
    user: Name | None = None
    # Beyond OpenAI, as in vLLM.
    top_k: StrictInt | None = Field(None, ge=-1, le=MAX_TOKEN_ID)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0, le=100.0)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: StrictInt = Field(
        0, ge=0, le=9, description="0 interactive (first), higher is later."
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="Prefix-cache namespace: only requests with the same salt share cached "
        "prompt blocks. Behind the gateway it is always the tenant's (a client's is replaced).",
    )
    logit_bias: dict[str, float] | None = Field(
        None,
        description="Token id (as a string) -> a bias in [-100, 100] added to its logit before "
        f"sampling (at most {MAX_LOGIT_BIAS_TOKENS} tokens; ids must be in the vocabulary).",
    )

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if isinstance(value, str):
            value = [value]
        if len(value or ()) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        for i, stop in enumerate(value or ()):
            if len(stop) > MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence may be at most {MAX_STOP_CHARS} characters")
            _check_text(stop, f"stop[{i}]")
        return value

    @field_validator("model", "user", "cache_salt")
    @classmethod
    def _is_text(cls, value: str | None) -> str | None:
        return None if value is None else _check_text(value, "the value")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        # Shapes and ranges here; ids against the model's vocabulary at the worker's edge.
        if len(value or ()) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens")
        for key, bias in (value or {}).items():
            if not key.isdigit() or not key.isascii() or len(key) > 10:
                raise ValueError(f"logit_bias keys must be token ids, got {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:  # NaN fails too
                raise ValueError(f"logit_bias values must be between -100 and 100, got {bias}")
        return value

    def logit_bias_items(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    def stop_list(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class ChatCompletionRequest(ToolFields, SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # OpenAI's fields that ask for what this server does not do: refused unless left at the
    # value that asks for nothing (see docs/api.md).
    modalities: Annotated[list[Word], Field(max_length=8)] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: Word | None = None
    verbosity: Word | None = None
    service_tier: Word | None = None
    store: StrictBool | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_retention: Word | None = None
    # Accepted, no effect on the answer: identifiers for abuse monitoring and cache routing
    # (the prefix cache here is automatic).
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None
    # vLLM's: variables for the chat template, such as Qwen3's `enable_thinking`. Names and
    # plain values only; the template's own (messages, tools…) are never replaced.
    chat_template_kwargs: (
        Annotated[dict[Word, bool | int | float | Name | None], Field(max_length=16)] | None
    ) = None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(m != "text" for m in value):
            raise refused("only the 'text' modality is supported by this server")
        return value

    @field_validator("audio", "prediction", "web_search_options")
    @classmethod
    def _not_offered(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise refused("this feature is not supported by this server")
        return value

    @field_validator("reasoning_effort", "verbosity", "prompt_cache_retention")
    @classmethod
    def _not_for_this_model(cls, value: str | None) -> str | None:
        if value is not None:
            raise refused("this parameter is not supported with this model")
        return value

    @field_validator("service_tier")
    @classmethod
    def _default_tier(cls, value: str | None) -> str | None:
        if value not in (None, "auto", "default"):
            raise refused("only the 'auto' and 'default' service tiers are offered")
        return value

    @field_validator("store")
    @classmethod
    def _stateless(cls, value: bool | None) -> bool | None:
        if value:
            raise refused("this server does not store completions; store must be false")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_needs_store(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value:
            # OpenAI's own rule: metadata only goes with stored completions.
            raise refused("metadata is only allowed when store is enabled (never, here)")
        return value


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: TokenCount | None = 16
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(None, ge=1, le=128)
    suffix: Text | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_is_text(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        batched = not isinstance(value, str) and value and not isinstance(value[0], int)
        if batched and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        if isinstance(value, str):
            at_most(value, MAX_TEXT_CHARS)
            _check_text(value, "prompt")
        elif not batched:
            check_token_ids(value, "prompt")  # type: ignore[arg-type]
        else:
            # Batched: texts or token-id lists (the field's type admits nothing else).
            for i, item in enumerate(cast("list[str | list[int]]", value)):
                if isinstance(item, str):
                    at_most(item, MAX_TEXT_CHARS)
                    _check_text(item, f"prompt[{i}]")
                else:
                    check_token_ids(item, f"prompt[{i}]")
        return value

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.echo:
            return "echo"
        return None
