"""Server-sent events as OpenAI streams them: `data: <json>` events, a final `data: [DONE]`.

Between a worker and the gateway each event of a generation may open with a token stamp, the
comment line `: tokens N` (N: the completion tokens the engine had generated when the event
was written, every choice together). A stream cut short is billed the stamp of the last event
that went to the client, whatever the events carried (text, tool-call arguments, Responses
events). Clients ignore comment lines, as the SSE specification says they must.
"""

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


TOKENS_STAMP = b": tokens "
# The header by which the gateway asks a worker for token stamps.
TOKEN_STAMPS_HEADER = "x-modelyard-token-stamps"


def stamped(event: bytes, completion_tokens: int) -> bytes:
    """`event` opened by its token stamp."""
    return TOKENS_STAMP + str(completion_tokens).encode() + b"\n" + event


def read_stamp(event: bytes) -> tuple[int | None, bytes]:
    """The event's token stamp (None: it has none) and the event without it."""
    if not event.startswith(TOKENS_STAMP):
        return None, event
    line, _, rest = event.partition(b"\n")
    try:
        return int(line[len(TOKENS_STAMP) :]), rest
    except ValueError:
        return None, rest


def sse_comment(text: str) -> bytes:
    """A comment line (clients ignore it; it keeps a quiet stream alive)."""
    return f": {text}\n\n".encode()
