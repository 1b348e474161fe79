"""Tool calling over chat: what the model is shown, what constrains it, and how its output
becomes `tool_calls`.

- The plan (`plan_tools`): `tools`/`tool_choice`/`parallel_tool_calls`, with the legacy
  `functions`/`function_call` mapped onto the same path (answered in the legacy shape).
- The prompt: `modelyard.worker.tool_prompt` (the template's own tool rendering, or the
  default tool prompt).
- The constraint (`tool_constraint`): `required` and a named choice compile a JSON schema from
  the tools' parameter schemas (one call `{"name", "arguments"}`, an array of them when
  parallel calls are allowed; a named choice: its arguments object), so the output always
  parses into valid calls. `auto` generates freely and a per-family parser finds the calls.
- The answer (`decode`; streams: `modelyard.worker.tool_stream`): content and calls with ids
  `call_…`, arguments as the model's JSON text, `finish_reason: "tool_calls"` (legacy:
  `function_call`).
"""

from __future__ import annotations

import enum
import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from modelyard.engine.client import SamplingParams, StructuredKind, StructuredOutput
from modelyard.protocol.errors import bad_request
from modelyard.protocol.openai import ChatCompletionRequest
from modelyard.protocol.tools import FunctionDefinition, FunctionName, NamedToolChoice
from modelyard.worker.fanout import Usage
from modelyard.worker.reasoning import Thinking
from modelyard.worker.tool_parsers import (
    CallScan,
    ParsedCall,
    ToolParser,
    call_from_text,
    object_chain,
)

# A parallel `required` answer holds at most this many calls, and no more than there are tools
# (a small model at temperature 1 would otherwise go on listing calls until max_tokens).
MAX_PARALLEL_CALLS = 4
_ID_ALPHABET = string.ascii_letters + string.digits


class ToolMode(enum.StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass
class ToolPlan:
    functions: list[FunctionDefinition]
    mode: ToolMode
    parallel: bool = True
    named: str | None = None
    legacy: bool = False  # asked with `functions`: answered with `message.function_call`

    @property
    def active(self) -> bool:
        return self.mode is not ToolMode.NONE and bool(self.functions)

    @property
    def constrained(self) -> bool:
        return self.mode in (ToolMode.REQUIRED, ToolMode.NAMED)

    @property
    def names(self) -> set[str]:
        return {f.name for f in self.functions}

    @property
    def finish_reason(self) -> str:
        return "function_call" if self.legacy else "tool_calls"


def plan_tools(req: ChatCompletionRequest) -> ToolPlan:
    """The request's tool plan; a 400 naming the field for a choice that cannot be met."""
    if req.functions is not None and req.tools is not None:
        raise bad_request("'functions' and 'tools' cannot be used together", "functions")
    if req.function_call is not None and req.tool_choice is not None:
        raise bad_request(
            "'function_call' and 'tool_choice' cannot be used together", "function_call"
        )
    legacy = req.functions is not None or req.function_call is not None
    functions = list(req.functions or []) or [t.function for t in req.tools or []]
    choice: Any = req.function_call if legacy else req.tool_choice
    param = "function_call" if legacy else "tool_choice"
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, NamedToolChoice | FunctionName):
        name = choice.function.name if isinstance(choice, NamedToolChoice) else choice.name
        if name not in {f.name for f in functions}:
            given = "functions" if legacy else "tools"
            message = f"'{param}' names the function '{name}', which is not among the {given}"
            raise bad_request(message, param, "invalid_value")
        return ToolPlan(functions, ToolMode.NAMED, False, name, legacy)
    mode = ToolMode(choice)
    if mode is ToolMode.REQUIRED and not functions:
        raise bad_request(f"'{param}' is only allowed when tools are specified", param)
    parallel = req.parallel_tool_calls is not False and not legacy
    return ToolPlan(functions, mode, parallel, None, legacy)


# ----- the constraint --------------------------------------------------------------------------


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists its properties
    and says nothing about others: what a caller means by a parameter list (OpenAI's strict
    mode asks for it), and what keeps a small model from inventing keys until max_tokens.
    Every output valid under the result is valid under `schema`."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("properties", "const", "enum", "default") else v
           for k, v in schema.items()}  # fmt: skip
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def _arguments_schema(f: FunctionDefinition) -> Any:
    return closed(f.parameters_schema())


def _call_schema(f: FunctionDefinition) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, "arguments": _arguments_schema(f)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_constraint(plan: ToolPlan) -> StructuredOutput | None:
    """The JSON schema a `required` or named choice constrains the output to; None for auto."""
    if not plan.constrained:
        return None
    if plan.mode is ToolMode.NAMED:
        schema = _arguments_schema(next(f for f in plan.functions if f.name == plan.named))
    else:
        calls = [_call_schema(f) for f in plan.functions]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = (
            {
                "type": "array",
                "items": one,
                "minItems": 1,
                "maxItems": min(len(calls), MAX_PARALLEL_CALLS),
            }
            if plan.parallel
            else one
        )
    spec = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    return StructuredOutput(StructuredKind.JSON_SCHEMA, spec)


# ----- the answer ------------------------------------------------------------------------------


def call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ChatJob:
    """A chat request made ready for the engine (`OpenAIServing.prepare_chat`)."""

    prompt: list[int]
    params: SamplingParams
    plan: ToolPlan
    parser: ToolParser
    k: int | None  # top logprobs asked for, None: no logprobs
    thinking: Thinking | None = None  # a reasoning model's: how its output splits

    @property
    def job(self) -> tuple[list[int], SamplingParams]:
        return (self.prompt, self.params)

    def usage(self) -> Usage:
        """The usage this request's outputs are counted into (its thinking tokens too)."""
        return Usage(reasoning=self.thinking.tokens() if self.thinking is not None else None)


@dataclass
class Decoded:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def decode(plan: ToolPlan, parser: ToolParser, text: str) -> Decoded:
    """A finished choice's text as content and calls."""
    if not plan.active:
        return Decoded(text)
    if plan.constrained:
        calls = _constrained_calls(plan, text)
        if calls:
            return Decoded(None, calls)
    parsed = parser.parse(text, plan.names)
    calls = parsed.calls if plan.parallel else parsed.calls[:1]
    return Decoded(parsed.content if calls else text, calls)


def constrained_objects(plan: ToolPlan, text: str) -> list[CallScan]:
    """The call objects of a `required` answer (one, or an array of them) as far as `text`
    goes; a named choice's answer is its arguments object alone (see `StreamDecoder`)."""
    pos = len(text) - len(text.lstrip())
    if plan.parallel:
        if not text.startswith("[", pos):
            return []
        pos += 1
    return object_chain(text, pos, ", ")


def _constrained_calls(plan: ToolPlan, text: str) -> list[ParsedCall]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []  # cut short by max_tokens: the text stays the answer
    if plan.mode is ToolMode.NAMED:
        if not isinstance(value, dict):
            return []
        return [ParsedCall(plan.named or "", text.strip())]
    items = value if isinstance(value, list) else [value]
    scans = constrained_objects(plan, text)
    if len(scans) != len(items):
        return []
    calls = [
        c
        for scan in scans
        if scan.end is not None
        and (c := call_from_text(text[scan.start : scan.end], plan.names)) is not None
    ]
    return calls if len(calls) == len(items) else []


def message(plan: ToolPlan, decoded: Decoded) -> dict[str, Any]:
    """The assistant message of a non-streamed choice."""
    msg: dict[str, Any] = {"role": "assistant", "content": decoded.content}
    if decoded.calls and plan.legacy:
        first = decoded.calls[0]
        msg["function_call"] = {"name": first.name, "arguments": first.arguments}
    elif decoded.calls:
        msg["tool_calls"] = [
            {
                "id": call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in decoded.calls
        ]
    return msg
