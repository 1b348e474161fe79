"""Streams of a chat request with tools (and of every Responses API request): the engine's
deltas decoded per choice into content, call heads, argument fragments and finishes
(`StreamDecoder`, `choice_events`), and those as OpenAI chat chunks (`chat_tool_stream`).

Tool-call deltas have OpenAI's shape: a first delta with the call's `index`, `id`, `type` and
`function.name` (arguments ""), then argument fragments as the arguments decode: a constrained
call (`required`, named) from its first token, an `auto` call once the parser has seen the
name of an offered tool. The fragments are the model's own text of the arguments object, so
joined they are exactly the arguments the same request gets without streaming. Content goes
out as it comes, holding back only what may start a call. A call cut short by `max_tokens`
has sent part of its arguments and ends with `finish_reason: "length"` (as OpenAI's do).

A reasoning model's thinking (`modelyard.worker.reasoning`) comes first as `Reasoning` events
(chat: `reasoning_content` deltas); content and calls are read from its answer only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from modelyard.protocol.sse import DONE, sse_data
from modelyard.worker.fanout import ENGINE_FAILURES, FanOut, Job, Usage, stream_error
from modelyard.worker.metrics import RequestTimer
from modelyard.worker.reasoning import ReasoningSplitter, Thinking
from modelyard.worker.tool_parsers import CallScan, ToolParser, scan_call
from modelyard.worker.tools import ToolMode, ToolPlan, call_id, constrained_objects, decode

ARGUMENT_FRAGMENT_CHARS = 16


@dataclass
class Content:
    index: int
    text: str


@dataclass
class Reasoning:
    index: int
    text: str  # the next characters of the thinking


@dataclass
class CallHead:
    index: int  # the choice
    call: int  # the call's place in the choice
    name: str


@dataclass
class CallArgs:
    index: int
    call: int
    text: str  # the next characters of the call's arguments


@dataclass
class CallDone:
    index: int
    call: int
    name: str
    arguments: str  # all of them (what the fragments joined to)
    complete: bool = True  # False: cut short (max_tokens), not a valid call


@dataclass
class Finished:
    index: int
    reason: str


Event = Reasoning | Content | CallHead | CallArgs | CallDone | Finished | Usage


def fragments(text: str, size: int = ARGUMENT_FRAGMENT_CHARS) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


@dataclass
class _Open:
    name: str
    sent: str = ""  # the argument characters sent so far


class StreamDecoder:
    """One streamed choice: its text as it grows, turned into events."""

    def __init__(
        self,
        plan: ToolPlan,
        parser: ToolParser,
        index: int = 0,
        splitter: ReasoningSplitter | None = None,
    ) -> None:
        self.splitter = splitter  # a reasoning model's: the thinking taken off first
        self.plan = plan
        self.parser = parser
        self.index = index
        self.text = ""
        self.sent = 0  # content characters sent
        self.opened: list[_Open] = []
        self.max_calls = 1 if plan.legacy or not plan.parallel else None

    def _objects(self) -> list[CallScan]:
        if self.plan.mode is ToolMode.NAMED:  # the answer is the arguments object itself
            start = len(self.text) - len(self.text.lstrip())
            if not self.text.startswith("{", start):
                return []
            scan = scan_call(self.text, start)
            return [CallScan(start, self.plan.named, start, scan.end, scan.end)]
        if self.plan.constrained:
            return constrained_objects(self.plan, self.text)
        return self.parser.call_objects(self.text)

    def feed(self, delta: str) -> list[Event]:
        """The events that can go out now."""
        if self.splitter is None:
            return self._answer(delta)
        thinking, answer = self.splitter.feed(delta)
        events: list[Event] = [Reasoning(self.index, thinking)] if thinking else []
        return events + self._answer(answer)

    def _answer(self, delta: str) -> list[Event]:
        self.text += delta
        if not self.plan.active:
            self.sent = len(self.text)
            return [Content(self.index, delta)] if delta else []
        events: list[Event] = []
        if not self.plan.constrained:
            end = self.parser.content_end(self.text)
            if end > self.sent:
                events.append(Content(self.index, self.text[self.sent : end]))
                self.sent = end
        for i, scan in enumerate(self._objects()[: self.max_calls]):
            if i == len(self.opened):
                if scan.name not in self.plan.names or scan.args_start is None:
                    break  # not known to be a call of an offered tool (yet)
                self.opened.append(_Open(scan.name))
                events.append(CallHead(self.index, i, scan.name))
            if scan.args_start is None:  # opened calls have theirs; this keeps mypy sure
                break
            call = self.opened[i]
            stop = scan.args_end if scan.args_end is not None else len(self.text)
            fragment = self.text[scan.args_start + len(call.sent) : stop]
            if fragment:
                call.sent += fragment
                events.append(CallArgs(self.index, i, fragment))
        return events

    def finish(self, reason: str) -> list[Event]:
        """The rest: content not sent yet, the calls' last fragments, their ends, the finish."""
        events: list[Event] = []
        if self.splitter is not None:
            thinking, answer = self.splitter.finish()
            events += [Reasoning(self.index, thinking)] if thinking else []
            events += self._answer(answer) if answer else []
        if not self.plan.active:
            return [*events, Finished(self.index, reason)]
        decoded = decode(self.plan, self.parser, self.text)
        content = decoded.content or ""
        # A begun call that did not complete is not content again (its text was sent as one).
        unsent = content[self.sent :] if content.startswith(self.text[: self.sent]) else ""
        if unsent and not (self.opened and not decoded.calls):
            events.append(Content(self.index, unsent))
        for i, call in enumerate(decoded.calls):
            if i >= len(self.opened):
                self.opened.append(_Open(call.name))
                events.append(CallHead(self.index, i, call.name))
            sent = self.opened[i].sent
            if call.arguments.startswith(sent):
                rest_args = call.arguments[len(sent) :]
                events += [CallArgs(self.index, i, f) for f in fragments(rest_args) if f]
            events.append(CallDone(self.index, i, call.name, call.arguments))
        for i in range(len(decoded.calls), len(self.opened)):  # begun, never completed
            cut = self.opened[i]
            events.append(CallDone(self.index, i, cut.name, cut.sent, complete=False))
        if decoded.calls:
            reason = self.plan.finish_reason
        events.append(Finished(self.index, reason))
        return events


async def choice_events(
    fanout: FanOut,
    request_id: str,
    jobs: list[Job],
    req: Any,
    plan: ToolPlan,
    parser: ToolParser,
    usage: Usage | None = None,
    thinking: Thinking | None = None,
) -> AsyncIterator[Event]:
    """Decoded events of every choice, then the usage; raises the engine's failures. `usage`
    (kept up to date as the outputs come) is the caller's, to stamp what it sends; `thinking`
    a reasoning model's."""
    timer = RequestTimer(fanout.metrics)
    usage = usage if usage is not None else Usage()
    decoders: dict[int, StreamDecoder] = {}
    async for pi, out in fanout.merged(request_id, jobs, req):
        usage.add(pi, out)
        timer.output(out)
        for d in out.deltas:
            index = pi * req.n + d.index
            decoder = decoders.get(index)
            if decoder is None:
                splitter = thinking.splitter() if thinking is not None else None
                decoder = decoders[index] = StreamDecoder(plan, parser, index, splitter)
            if d.text:
                for event in decoder.feed(d.text):
                    yield event
            if d.finish_reason is not None:
                for event in decoder.finish(d.finish_reason.value):
                    yield event
    timer.done(*usage.totals())
    yield usage


def _call_delta(plan: ToolPlan, event: CallHead | CallArgs) -> dict[str, Any]:
    """The chat delta of a call's head or of one argument fragment."""
    if plan.legacy:
        if isinstance(event, CallHead):
            return {"function_call": {"name": event.name, "arguments": ""}}
        return {"function_call": {"arguments": event.text}}
    if isinstance(event, CallHead):
        head = {"index": event.call, "id": call_id(), "type": "function"}
        return {"tool_calls": [{**head, "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.call, "function": {"arguments": event.text}}]}


async def chat_tool_stream(
    events: AsyncIterator[Event],
    base: dict[str, Any],
    num_choices: int,
    plan: ToolPlan,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    def chunk(index: int, delta: dict[str, Any], reason: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        return sse_data({**base, "choices": [choice]})

    try:
        for i in range(num_choices):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for event in events:
            if isinstance(event, Content):
                yield chunk(event.index, {"content": event.text})
            elif isinstance(event, Reasoning):
                yield chunk(event.index, {"reasoning_content": event.text})
            elif isinstance(event, CallHead | CallArgs):
                yield chunk(event.index, _call_delta(plan, event))
            elif isinstance(event, CallDone):
                continue  # the chat shape has no end-of-call delta
            elif isinstance(event, Finished):
                yield chunk(event.index, {}, event.reason)
            elif include_usage:
                yield sse_data({**base, "choices": [], "usage": event.as_dict()})
    except ENGINE_FAILURES as exc:
        yield sse_data(stream_error(exc))
    yield DONE
