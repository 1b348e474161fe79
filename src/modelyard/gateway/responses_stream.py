"""Metering the Responses API's typed SSE events (`event: <type>` + `data: <json>`), which
the relay passes through as they are.

Events are metered by their token stamps (see `relay.py`); a stream without stamps counts one
completion token per delta event (output text, function-call arguments, reasoning). The
final event (`response.completed`, or `response.incomplete` when `max_output_tokens` cut it)
carries the usage that is billed, read before the client receives it.
"""

from __future__ import annotations

import time

import orjson

from modelyard.gateway.call import Call, error_status, take_usage

TYPED_PREFIX = b"event: "
FINAL_EVENTS = (b"event: response.completed\n", b"event: response.incomplete\n")
_DELTA = b".delta\n"  # response.output_text.delta, response.function_call_arguments.delta, ...
_FAILED = (b"event: response.failed\n", b"event: error\n")


def is_typed(event: bytes) -> bool:
    return event.startswith(TYPED_PREFIX)


def is_final(event: bytes) -> bool:
    return event.startswith(FINAL_EVENTS)


def inspect_typed(call: Call, event: bytes) -> bool:
    """Meter one typed event; every one of them reaches the client."""
    kind = event.partition(b"\n")[0] + b"\n"
    if kind.endswith(_DELTA):
        if call.stamped:
            return True
        call.completion_tokens += 1
        if call.ttft is None:
            call.ttft = time.perf_counter() - call.started
    elif event.startswith(_FAILED):
        data = event.split(b"\ndata: ", 1)
        try:
            obj = orjson.loads(data[1]) if len(data) == 2 else {}
        except orjson.JSONDecodeError:
            obj = {}
        call.status = error_status(
            obj.get("error") or (obj.get("response") or {}).get("error") or obj
        )
    elif is_final(event):
        data = event.split(b"\ndata: ", 1)
        try:
            obj = orjson.loads(data[1]) if len(data) == 2 else {}
        except orjson.JSONDecodeError:
            return True
        usage = ((obj.get("response") or {}).get("usage")) or {}
        if usage:  # input_tokens / output_tokens
            take_usage(call, usage)
    return True
