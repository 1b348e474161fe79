"""Structured outputs at the worker's edge: a request's `response_format` / `guided_*` fields
turned into one `StructuredOutput`, and that compiled (off the event loop) before it is queued.

A request may ask for one constraint only: two at once (`response_format` json_schema and
`guided_regex`, say) is a 400 naming both. A schema, regex or grammar that does not compile is a
400 naming the field; the engine never sees it. The tools path builds its own `StructuredOutput`
(from the tools' parameter schemas) and compiles it with `compile_structured` too.

Compiling (and each request's fresh matcher, probed on its first mask) runs on the engine
client's grammar threads (`EngineClient.compile_grammar`), with stacks sized for what
`MAX_SPEC_CHARS` allows (see `engine/client.py`).
"""

from __future__ import annotations

import json
from typing import Any

from modelyard.engine.client import EngineClient, StructuredKind, StructuredOutput
from modelyard.protocol.errors import APIError, bad_request
from modelyard.protocol.structured import (
    ResponseFormatJSONObject,
    ResponseFormatJSONSchema,
    StructuredFields,
)

# Bounds on what a request may ask the grammar compiler to chew on.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024


def _text(value: str, param: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param} is not valid Unicode text", param, "invalid_value") from None
    if len(value) > MAX_SPEC_CHARS:
        raise bad_request(
            f"{param} is {len(value)} characters long; at most {MAX_SPEC_CHARS} are allowed",
            param,
            "invalid_value",
        )
    return value


def _schema_text(schema: Any, param: str) -> str:
    # Compact, keys in the caller's order: property order is the order the model writes them.
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise bad_request(f"{param} is not a valid JSON schema: {exc}", param) from None
    return _text(text, param)


def _from_response_format(req: StructuredFields) -> StructuredOutput | None:
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJSONObject):
        return StructuredOutput(StructuredKind.JSON_OBJECT, "")
    if isinstance(fmt, ResponseFormatJSONSchema):
        schema = fmt.json_schema.schema_
        if schema is None:  # no schema given: any JSON object, as json_object
            return StructuredOutput(StructuredKind.JSON_OBJECT, "")
        return StructuredOutput(
            StructuredKind.JSON_SCHEMA, _schema_text(schema, "response_format.json_schema.schema")
        )
    return None  # absent or {"type": "text"}


def _from_guided_json(value: dict[str, Any] | str) -> StructuredOutput:
    if isinstance(value, str):
        try:
            value = json.loads(_text(value, "guided_json"))
        except json.JSONDecodeError as exc:
            raise bad_request(f"guided_json is not valid JSON: {exc}", "guided_json") from None
        if not isinstance(value, dict):
            raise bad_request("guided_json must be a JSON schema object", "guided_json")
    return StructuredOutput(StructuredKind.JSON_SCHEMA, _schema_text(value, "guided_json"))


def _from_choices(choices: list[str]) -> StructuredOutput:
    if not choices:
        raise bad_request("guided_choice must list at least one choice", "guided_choice")
    if len(choices) > MAX_CHOICES:
        raise bad_request(f"guided_choice allows at most {MAX_CHOICES} choices", "guided_choice")
    for i, choice in enumerate(choices):
        _text(choice, f"guided_choice[{i}]")
    return StructuredOutput(
        StructuredKind.CHOICE, _text(json.dumps(choices, ensure_ascii=False), "guided_choice")
    )


def requested_constraints(req: StructuredFields) -> dict[str, StructuredOutput]:
    """Every structured-output field the request set, by its name (built, not compiled)."""
    found: dict[str, StructuredOutput] = {}
    from_format = _from_response_format(req)
    if from_format is not None:
        found["response_format"] = from_format
    if req.guided_json is not None:
        found["guided_json"] = _from_guided_json(req.guided_json)
    if req.guided_regex is not None:
        found["guided_regex"] = StructuredOutput(
            StructuredKind.REGEX, _text(req.guided_regex, "guided_regex")
        )
    if req.guided_choice is not None:
        found["guided_choice"] = _from_choices(req.guided_choice)
    if req.guided_grammar is not None:
        found["guided_grammar"] = StructuredOutput(
            StructuredKind.GRAMMAR, _text(req.guided_grammar, "guided_grammar")
        )
    return found


def structured_field(req: StructuredFields) -> str | None:
    """The name of the field that asked for structured output (for error messages), if any."""
    return next(iter(requested_constraints(req)), None)


def structured_output_from_request(req: StructuredFields) -> StructuredOutput | None:
    """The request's one output constraint, or None. Two at once is a 400 naming both."""
    found = requested_constraints(req)
    if len(found) > 1:
        first, second = list(found)[:2]
        raise bad_request(
            f"'{first}' and '{second}' cannot be used together: choose one output constraint",
            second,
            "invalid_value",
        )
    return next(iter(found.values()), None)


async def compile_structured(
    engine: EngineClient, structured: StructuredOutput | None, param: str = "response_format"
) -> StructuredOutput | None:
    """`structured` with this request's own matcher attached (compiled on a grammar thread, the
    grammar cached by the engine's grammar cache), or a 400 naming `param` when it does not
    compile or breaks on its first mask."""
    if structured is None:
        return None
    try:
        return await engine.compile_grammar(structured)
    except ValueError as exc:
        raise _compile_error(exc, param) from None


def _compile_error(exc: ValueError, param: str) -> APIError:
    return bad_request(f"Invalid {param}: {exc}", param, "invalid_value")


async def structured_for(engine: EngineClient, req: StructuredFields) -> StructuredOutput | None:
    """The compiled constraint of an API request (`response_format` or a `guided_*` field)."""
    structured = structured_output_from_request(req)
    if structured is None:
        return None
    return await compile_structured(engine, structured, structured_field(req) or "response_format")
