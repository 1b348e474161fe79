"""The hard bounds of every inference request field: lengths of texts and lists, ranges of
numbers, the depth of free-form JSON (tool parameters, JSON schemas).

Schemas check these before anything else looks at a request, at the gateway and again at the
worker (a batch line gets the same check), so no field reaches code that could spend unbounded
time or memory on it. They are edge bounds, generous enough for every real client; what a
model can take (its context, its vocabulary) is checked against the model at the worker
(`modelyard.worker.prompt_bounds`, `modelyard.engine.request_checks`).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, Field

T = TypeVar("T")
S = TypeVar("S", bound="Sized | None")  # a text, a list, or nothing

# One text field (a message's content, a prompt, a tool's arguments or output, instructions):
# OpenAI's own limit on a message's content (10,485,760) would never bind behind the 8 MiB body
# cap; this is that cap in characters, so a batch line is held to what a request is.
MAX_TEXT_CHARS = 8 * 2**20
# Names and identifiers (model, user, tool call ids, function names in the history).
MAX_NAME_CHARS = 512
# Enumerations sent as strings (service_tier, reasoning_effort, status…).
MAX_WORD_CHARS = 64
# Messages (chat) or input items (Responses) of one request; content parts of one message;
# tool calls of one assistant message.
MAX_MESSAGES = 65_536
MAX_CONTENT_PARTS = 4096
MAX_TOOL_CALLS = 128
# Output-only lists a client may echo back (annotations, logprobs): ignored, but bounded.
MAX_ECHOED_ITEMS = 1024
# Token counts and ids: above every context and vocabulary there is.
MAX_TOKENS_FIELD = 2**24
MAX_TOKEN_ID = 2**31 - 1
# As the engine's own limits (`modelyard.engine.sampling_params`), which say why on a 400.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# Free-form JSON (tool parameters, JSON schemas, guided_json): nesting depth and values. OpenAI
# allows 10 levels of nested objects and 5,000 properties in a schema (about 20 levels of JSON);
# far above that, recursive code (grammar compilers, templates' tojson, json.dumps) would break.
MAX_JSON_DEPTH = 64
MAX_JSON_NODES = 10_000
# Grammar specs: `modelyard.worker.structured` refuses longer ones with its own message.
MAX_SPEC_CHARS = 64 * 1024
MAX_GUIDED_CHOICES = 1024


def bounded_json(value: T) -> T:
    """`value` if its nesting depth and node count are within bounds, else a ValueError naming
    the bound. Iterative: a deep value cannot overflow the stack here."""
    if value is None:
        return value
    stack: list[tuple[Any, int]] = [(value, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_JSON_NODES:
            raise ValueError(f"the JSON value holds more than {MAX_JSON_NODES} values")
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"the JSON value is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(node, dict):
            for key, item in node.items():
                if len(key) > MAX_TEXT_CHARS:
                    raise ValueError("a key of the JSON value is too long")
                stack.append((item, depth + 1))
        elif isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
    return value


def at_most(value: S, limit: int, what: str = "characters") -> S:
    """`value` (a text or a list) if it holds at most `limit` characters or items."""
    if value is not None and len(value) > limit:
        raise ValueError(f"at most {limit} {what} are allowed here, got {len(value)}")
    return value


def _chars(limit: int) -> AfterValidator:
    # Checked after the plain `str` schema: a length constraint inside pydantic-core would
    # refuse a lone surrogate with its own message, before the schemas' own check names it.
    return AfterValidator(lambda value: at_most(value, limit))


# Plain-typed fields only: in a union, an error's location would carry pydantic's member tag
# (`content.function-after[...]`), so union fields check `at_most` in their own validator.
Text = Annotated[str, _chars(MAX_TEXT_CHARS)]
Name = Annotated[str, _chars(MAX_NAME_CHARS)]
Word = Annotated[str, _chars(MAX_WORD_CHARS)]
SpecText = Annotated[str, _chars(MAX_SPEC_CHARS)]
# Strict: JSON `true`, `"5"` or `5.0` is not a count (pydantic's lax mode would take them).
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID, strict=True)]
TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS_FIELD, strict=True)]
JSONObject = Annotated[dict[str, Any], AfterValidator(bounded_json)]
EchoedList = Annotated[list[Any], Field(max_length=MAX_ECHOED_ITEMS), AfterValidator(bounded_json)]


def check_token_ids(ids: list[int], where: str) -> None:
    """Token ids given as a prompt or input: within a plausible vocabulary (the model's own is
    checked by the worker)."""
    at_most(ids, MAX_TOKENS_FIELD, "token ids")
    for token in ids:
        if not 0 <= token <= MAX_TOKEN_ID:
            raise ValueError(f"{where} holds {token}, not a token id")
