"""Tool calls in a model's free text (`tool_choice: auto`): one parser per output convention.

- `hermes` (Hermes, Qwen 2/2.5/3, and this server's default tool prompt): calls are
  `<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks after optional content.
- `llama3_json` (Llama 3.1+ JSON tool calling): the whole answer is `{"name": …,
  "parameters": {…}}` (optionally after `<|python_tag|>`, several separated by `;`).

A parser is chosen per model (`parser_for`: the chat template's own convention, else the model
family, else Hermes) from a registry that other conventions plug into (`register`). A parser
also says how much of a growing text is surely content (`content_end`), so that streams send
content as it comes and hold back only what may be the start of a call. Calls naming a function
the request did not offer, or whose arguments are not a JSON object, are not calls: the text
stays content, as vLLM does.

A call's arguments are the model's own text of the arguments object (`scan_call` finds its
span), not a re-serialisation: a stream sends that text as it decodes (`call_objects` finds the
calls begun so far), and the same characters are the arguments of the unstreamed answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # compact JSON text of an object


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def arguments_text(arguments: Any) -> str:
    """The one spelling of a call's arguments, streamed or not: compact JSON, keys in order."""
    return json.dumps(arguments, ensure_ascii=False, separators=(", ", ": "))


def call_from_object(obj: Any, names: Collection[str]) -> ParsedCall | None:
    """A `{"name", "arguments"|"parameters"}` object as a call, if it names an offered tool."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(str(obj["name"]), arguments_text(args))


ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class CallScan:
    """What is known of one call object `{"name": …, "arguments": {…}}` in a growing text."""

    start: int  # offset of its `{`
    name: str | None = None  # once its string is complete
    args_start: int | None = None  # offset of the arguments object's `{` (None: not yet, or
    args_end: int | None = None  # the arguments are not an object) and just past its `}`
    end: int | None = None  # just past the call object's `}`


def scan_call(text: str, start: int) -> CallScan:
    """Scan the JSON object starting at `text[start]` (a `{`) as far as `text` goes."""
    scan = CallScan(start)
    depth, in_string, escaped, string_start = 0, False, False, 0
    at_key, key, value_of = True, None, None  # at depth 1: the key whose value is being read
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 1:
                    literal = _string(text[string_start : i + 1])
                    if at_key:
                        key = literal
                    elif value_of == "name" and scan.name is None:
                        scan.name = literal
            continue
        if ch == '"':
            in_string, string_start = True, i
        elif ch in "{[":
            depth += 1
            if depth == 2 and ch == "{" and value_of in ARGUMENT_KEYS and scan.args_start is None:
                scan.args_start = i
        elif ch in "}]":
            depth -= 1
            if depth == 1 and scan.args_start is not None and scan.args_end is None:
                scan.args_end = i + 1
            if depth == 0:
                scan.end = i + 1
                return scan
        elif depth == 1 and ch == ":":
            at_key, value_of = False, key
        elif depth == 1 and ch == ",":
            at_key, value_of = True, None
    return scan


def _string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def object_chain(text: str, pos: int, separators: str) -> list[CallScan]:
    """The objects that follow each other from `pos` (between them only `separators`), as far
    as `text` goes: the calls of a Llama 3 answer or of a constrained array."""
    scans: list[CallScan] = []
    while pos < len(text) and text[pos] == "{":
        scan = scan_call(text, pos)
        scans.append(scan)
        if scan.end is None:
            break
        pos = scan.end
        while pos < len(text) and text[pos] in separators:
            pos += 1
    return scans


def call_from_text(body: str, names: Collection[str]) -> ParsedCall | None:
    """One call object's text as a call (its arguments in the model's own spelling)."""
    body = body.strip()
    try:
        call = call_from_object(json.loads(body), names)
    except json.JSONDecodeError:
        return None
    if call is None:
        return None
    scan = scan_call(body, 0) if body.startswith("{") else None
    if scan is not None and scan.args_start is not None and scan.args_end is not None:
        return ParsedCall(call.name, body[scan.args_start : scan.args_end])
    return call  # arguments written as JSON text: their decoded object, re-spelled


def _held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back in streams)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolParser(Protocol):
    name: ClassVar[str]

    def parse(self, text: str, names: Collection[str]) -> ParsedOutput: ...

    def content_end(self, text: str) -> int:
        """How many leading characters of `text` are content whatever follows."""
        ...

    def call_objects(self, text: str) -> list[CallScan]:
        """The call objects begun so far in a growing `text` (streams send their arguments)."""
        ...


class HermesParser:
    name: ClassVar[str] = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, names: Collection[str]) -> ParsedOutput:
        start = text.find(self.OPEN)
        if start < 0:
            return ParsedOutput(text)
        calls: list[ParsedCall] = []
        rest = text[start:]
        while rest.startswith(self.OPEN):
            body_end = rest.find(self.CLOSE)
            body = rest[len(self.OPEN) : body_end if body_end >= 0 else len(rest)]
            call = call_from_text(body, names)
            if call is None:
                return ParsedOutput(text)  # not a well-formed call: the text is the answer
            calls.append(call)
            if body_end < 0:
                break
            rest = rest[body_end + len(self.CLOSE) :].lstrip()
        return ParsedOutput(text[:start].rstrip() or None, calls)

    def call_objects(self, text: str) -> list[CallScan]:
        scans: list[CallScan] = []
        at = text.find(self.OPEN)
        while at >= 0:
            pos = at + len(self.OPEN)
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos < len(text) and text[pos] == "{":
                scans.append(scan_call(text, pos))
            at = text.find(self.OPEN, pos)
        return scans

    def content_end(self, text: str) -> int:
        start = text.find(self.OPEN)
        if start >= 0:
            return len(text[:start].rstrip())
        end = len(text) - _held_prefix(text, self.OPEN)
        return len(text[:end].rstrip())


class Llama3JsonParser:
    name: ClassVar[str] = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, names: Collection[str]) -> ParsedOutput:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].strip()
        if not body.startswith("{"):
            return ParsedOutput(text)
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                start, (_, pos) = pos, decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return ParsedOutput(text)
            call = call_from_text(body[start:pos], names)
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ParsedOutput(None, calls)

    def call_objects(self, text: str) -> list[CallScan]:
        pos = len(text) - len(text.lstrip())
        if text.startswith(self.TAG, pos):
            pos += len(self.TAG)
            while pos < len(text) and text[pos].isspace():
                pos += 1
        return object_chain(text, pos, " \t\r\n;")

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body[0] in "{<":
            return 0  # may be a call: hold it all
        return len(text.rstrip())


_REGISTRY: dict[str, Callable[[], ToolParser]] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
}
DEFAULT_PARSER = HermesParser.name


def register(name: str, factory: Callable[[], ToolParser]) -> None:
    """Plug in a parser for another convention (`parser_for` picks it by name)."""
    _REGISTRY[name] = factory


def get_parser(name: str) -> ToolParser:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r} (known: {', '.join(_REGISTRY)})") from None


def parser_for(model_type: str, chat_template: str | None, renders_tools: bool) -> ToolParser:
    """The parser for a model: the convention its chat template teaches when it renders tools
    itself; Hermes when the server's default tool prompt (which teaches Hermes) is used."""
    template = chat_template or ""
    if renders_tools:
        if "<tool_call>" in template:
            return get_parser("hermes")
        if model_type == "llama" and ("<|python_tag|>" in template or "ipython" in template):
            return get_parser("llama3_json")
    return get_parser(DEFAULT_PARSER)
