"""Server-sent events as OpenAI streams them: `data: <json>` events, a final `data: [DONE]`."""

from __future__ import annotations

from typing import Any

import orjson

# One event ends with a blank line.
EVENT_END = b"\n\n"
DATA_PREFIX = b"data: "
# The last event of an OpenAI stream, without and with its terminator.
DONE_EVENT = b"data: [DONE]"
DONE = DONE_EVENT + EVENT_END


def sse_data(obj: Any) -> bytes:
    """One `data:` event carrying `obj` as JSON."""
    return DATA_PREFIX + orjson.dumps(obj) + EVENT_END


def sse_raw(payload: bytes) -> bytes:
    """One `data:` event carrying already serialised JSON."""
    return DATA_PREFIX + payload + EVENT_END


def sse_comment(text: str) -> bytes:
    """A comment line (clients ignore it; it keeps a quiet stream alive)."""
    return f": {text}\n\n".encode()
