"""The Responses API (`POST /v1/responses`, stateless) as a translation onto chat.

A request becomes a chat completion request (`to_chat`: `instructions` as the system message,
input items as messages, function tools as chat tools, `text.format` as `response_format`,
`max_output_tokens` as `max_completion_tokens`) and runs on the chat path, tools and
constraints included; its answer becomes a `response` object whose output holds a `reasoning`
item (a reasoning model's thinking, as `reasoning_text` content), a `message` item and/or
`function_call` items. A stream sends the Responses API's typed events
(`event: <type>` + `data:`), from `response.created` to `response.completed`, whose usage
(`input_tokens`, `output_tokens`) is what the gateway bills. The gateway's prefix keys of the
request (cache-aware routing) are noted as that chat's: it keys a Responses request as the chat
it becomes (`core/prefix_keys.py`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from modelyard.protocol.disconnect import run_until_disconnect
from modelyard.protocol.errors import APIError, bad_request, validation_error
from modelyard.protocol.openai import PROMPT_TOKENS_HEADER, ChatCompletionRequest
from modelyard.protocol.responses import JSONResponse
from modelyard.protocol.responses_api import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
    TextFormatJSONObject,
    TextFormatJSONSchema,
)
from modelyard.worker import prefix_notes
from modelyard.worker.fanout import ENGINE_FAILURES, Usage, api_error, stamp_tokens, wants_stamps
from modelyard.worker.openai_serving import OpenAIServing
from modelyard.worker.tool_stream import (
    CallArgs,
    CallDone,
    CallHead,
    Content,
    Finished,
    Reasoning,
    choice_events,
)
from modelyard.worker.tools import ChatJob, call_id

_PASSED_ON = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "seed", "priority", "cache_salt", "parallel_tool_calls",
              "user")  # fmt: skip


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses API request runs as."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else []
    for item in items or req.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn: text and calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not any(m["role"] != "system" or m is not messages[0] for m in messages):
        raise bad_request("'input' must hold at least one item", "input", "invalid_value")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens,
    }
    body.update({k: v for k in _PASSED_ON if (v := getattr(req, k)) is not None})
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    if req.tool_choice is not None:
        choice = req.tool_choice
        named = {"type": "function", "function": {"name": getattr(choice, "name", "")}}
        body["tool_choice"] = choice if isinstance(choice, str) else named
    fmt = req.text.format if req.text else None
    if isinstance(fmt, TextFormatJSONObject):
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, TextFormatJSONSchema):
        spec = fmt.spec().model_dump(by_alias=True, exclude_none=True)
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _renamed(validation_error(exc.errors())) from exc


# The chat path's 400s name chat's fields; the client sent the Responses API's.
_FIELD_NAMES = {
    "messages": "input",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}


def _renamed(exc: APIError) -> APIError:
    """`exc` naming the Responses API's field (`response_format.x` becomes `text.format.x`)."""
    head, dot, rest = (exc.param or "").partition(".")
    if head in _FIELD_NAMES:
        exc.param = _FIELD_NAMES[head] + dot + rest
    return exc


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0
            )
        },
        "total_tokens": prompt + completion,
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content if status == "completed" else []}  # fmt: skip


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": content if status == "completed" else []}  # fmt: skip


def _call_item(
    call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}  # fmt: skip


class ResponsesServing:
    """`/v1/responses` on top of the chat serving of the same worker."""

    def __init__(self, chat: OpenAIServing) -> None:
        self.chat = chat

    def _envelope(
        self, req: ResponsesRequest, response_id: str, created: int, status: str
    ) -> dict[str, Any]:
        fmt = req.text.format if req.text and req.text.format else None
        choice = req.tool_choice
        return {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.chat.model_name,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True) if fmt else {"type": "text"}},
            "tool_choice": choice.model_dump()
            if choice and not isinstance(choice, str)
            else (choice or "auto"),
            "tools": [t.model_dump() for t in req.tools or []],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
            "metadata": {},
        }

    async def create(self, req: ResponsesRequest, request: Request) -> Any:
        chat_req = to_chat(req)
        try:
            job = await self.chat.prepare_chat(chat_req)
        except APIError as exc:
            _renamed(exc)
            raise
        # The gateway keyed it as this chat (`core/prefix_keys.py`): its cache-aware routing.
        prefix_notes.note(self.chat.engine, request.headers, job.prompt, chat_req.cache_salt,
                          job.params)  # fmt: skip
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        response_id = f"resp_{request_id}"
        created = int(time.time())
        envelope = self._envelope(req, response_id, created, "in_progress")
        if req.stream:
            usage = job.usage()
            stream = self._stream(chat_req, job, request_id, envelope, usage)
            events: AsyncIterator[bytes] = (
                stamp_tokens(stream, usage) if wants_stamps(request.headers) else stream
            )
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-accel-buffering": "no",
                         "x-request-id": request_id, PROMPT_TOKENS_HEADER: str(len(job.prompt))},
            )  # fmt: skip
        body = await run_until_disconnect(request, self.chat.chat_body(job, chat_req, request_id))
        choice = body["choices"][0]
        msg = choice["message"]
        output = []
        if msg.get("reasoning_content"):
            output.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", msg["reasoning_content"]))
        if msg.get("content"):
            output.append(_message_item(f"msg_{uuid.uuid4().hex}", msg["content"]))
        for tc in msg.get("tool_calls") or []:
            output.append(_call_item(tc["id"], tc["function"]["name"], tc["function"]["arguments"]))
        cut = choice["finish_reason"] == "length"
        return JSONResponse(
            {
                **envelope,
                "status": "incomplete" if cut else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "output": output,
                "usage": _usage(body["usage"]),
            },
            headers={"x-request-id": request_id},
        )

    async def _stream(
        self,
        chat_req: ChatCompletionRequest,
        job: ChatJob,
        request_id: str,
        envelope: dict[str, Any],
        counted: Usage,
    ) -> AsyncGenerator[bytes, None]:
        seq = 0

        def event(kind: str, **data: Any) -> bytes:
            nonlocal seq
            payload = orjson.dumps({"type": kind, "sequence_number": seq, **data})
            seq += 1
            return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

        yield event("response.created", response=envelope)
        yield event("response.in_progress", response=envelope)
        output: list[dict[str, Any]] = []
        text: str | None = None  # the open message's text so far
        msg_id = f"msg_{uuid.uuid4().hex}"
        calls: dict[int, tuple[int, dict[str, Any]]] = {}  # call -> (output index, its item)
        reason, usage = "stop", None
        thought: str | None = None  # the open reasoning item's text so far
        rs_id = f"rs_{uuid.uuid4().hex}"

        def open_item(item: dict[str, Any], part: dict[str, Any]) -> list[bytes]:
            """An item (reasoning or message) and its one content part begin, at the end."""
            index = len(output)
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            return [
                event("response.output_item.added", output_index=index, item=item),
                event("response.content_part.added", **at, part=part),
            ]

        def close_reasoning() -> list[bytes]:
            nonlocal thought
            if thought is None:
                return []
            index, part = len(output), {"type": "reasoning_text", "text": thought}
            at = {"item_id": rs_id, "output_index": index, "content_index": 0}
            item = _reasoning_item(rs_id, thought)
            output.append(item)
            thought = None
            return [
                event("response.reasoning_text.done", **at, text=part["text"]),
                event("response.content_part.done", **at, part=part),
                event("response.output_item.done", output_index=index, item=item),
            ]

        def close_text() -> list[bytes]:
            nonlocal text
            if text is None:
                return []
            index, part = len(output), {"type": "output_text", "text": text, "annotations": [],
                                         "logprobs": []}  # fmt: skip
            at = {"item_id": msg_id, "output_index": index, "content_index": 0}
            item = _message_item(msg_id, text)
            output.append(item)
            text = None
            return [
                event("response.output_text.done", **at, text=part["text"], logprobs=[]),
                event("response.content_part.done", **at, part=part),
                event("response.output_item.done", output_index=index, item=item),
            ]

        events = choice_events(
            self.chat.fanout, request_id, [job.job], chat_req, job.plan, job.parser, counted,
            job.thinking,
        )  # fmt: skip
        try:
            async for ev in events:
                if isinstance(ev, Reasoning):
                    at = {"item_id": rs_id, "output_index": len(output), "content_index": 0}
                    if thought is None:
                        thought = ""
                        empty = {"type": "reasoning_text", "text": ""}
                        for chunk in open_item(_reasoning_item(rs_id, "", "in_progress"), empty):
                            yield chunk
                    thought += ev.text
                    yield event("response.reasoning_text.delta", **at, delta=ev.text)
                    continue
                for chunk in close_reasoning():  # the thinking comes before all else
                    yield chunk
                if isinstance(ev, Content):
                    at = {"item_id": msg_id, "output_index": len(output), "content_index": 0}
                    if text is None:
                        text = ""
                        part = {"type": "output_text", "text": "", "annotations": [],
                                "logprobs": []}  # fmt: skip
                        for chunk in open_item(_message_item(msg_id, "", "in_progress"), part):
                            yield chunk
                    text += ev.text
                    yield event("response.output_text.delta", **at, delta=ev.text, logprobs=[])
                elif isinstance(ev, CallHead):
                    for chunk in close_text():
                        yield chunk
                    call_item = _call_item(call_id(), ev.name, "", "in_progress")
                    calls[ev.call] = (len(output), call_item)
                    output.append(call_item)  # its place; replaced by the done item
                    yield event("response.output_item.added", output_index=len(output) - 1,
                                item=call_item)  # fmt: skip
                elif isinstance(ev, CallArgs):
                    index, call_item = calls[ev.call]
                    yield event("response.function_call_arguments.delta", item_id=call_item["id"],
                                output_index=index, delta=ev.text)  # fmt: skip
                elif isinstance(ev, CallDone):
                    index, call_item = calls[ev.call]
                    at = {"item_id": call_item["id"], "output_index": index}
                    yield event("response.function_call_arguments.done", **at,
                                arguments=ev.arguments)  # fmt: skip
                    status = "completed" if ev.complete else "incomplete"
                    output[index] = {**call_item, "arguments": ev.arguments, "status": status}
                    yield event("response.output_item.done", output_index=index,
                                item=output[index])  # fmt: skip
                elif isinstance(ev, Finished):
                    reason = ev.reason
                elif isinstance(ev, Usage):
                    usage = ev.as_dict()
            for chunk in close_reasoning() + close_text():
                yield chunk
        except ENGINE_FAILURES as exc:
            error = api_error(exc)
            why = {"code": error.code or "server_error", "message": error.message}
            failed = {**envelope, "status": "failed", "output": output, "error": why}
            yield event("response.failed", response=failed)
            return
        cut = reason == "length"
        final = {
            **envelope,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": output,
            "usage": _usage(usage) if usage else None,
        }
        yield event("response.incomplete" if cut else "response.completed", response=final)
