"""Logging of every process (`serve`, `worker`, `encoders`): one setup, text or JSON lines, and
the request each line belongs to.

The request's id lives in a contextvar that the HTTP middleware of the gateway and of the worker
set (`gateway/request_context.py`, `worker/request_context.py`), so every line logged while a
request is handled, by any module, carries it without being passed along; tasks started by the
request inherit it. In JSON mode each line is one object: `ts`, `level`, `logger`, `msg`, the
request ids when there are some, and whatever the call passed as `extra=`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextvars import ContextVar
from typing import Any

import orjson

from modelyard.config import TelemetrySettings

# The platform's own id of the request being handled (the gateway makes it; the worker takes
# the gateway's from `x-request-id`); and the id a client sent, logged but never trusted.
REQUEST_ID: ContextVar[str | None] = ContextVar("modelyard_request_id", default=None)
CLIENT_REQUEST_ID: ContextVar[str | None] = ContextVar("modelyard_client_request_id", default=None)

MAX_REQUEST_ID_CHARS = 128
# Set by a platform in the replicas it starts (`control/backends/local.py`).
PARENT_PID_ENV = "MODELYARD_PARENT_PID"
_PROBE_PATHS = frozenset({"/health", "/metrics", "/v2/health/live", "/v2/health/ready"})

# Loggers that say a line per connection or per plugin at INFO/DEBUG: kept at WARNING or above.
_NOISY = ("httpx", "httpcore", "alembic.runtime.plugins", "asyncio", "urllib3", "multipart",
          "python_multipart", "filelock", "aiosqlite", "hpack")  # fmt: skip

# What every LogRecord has; anything else on a record came from `extra=` and is a field.
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",  # uvicorn's ANSI-colored copy of the message
}


def valid_request_id(value: str | None) -> str | None:
    """A caller's request id if it is 1-128 printable ASCII characters, else None (dropped: a
    header is hostile and ends up in log lines)."""
    if not value or len(value) > MAX_REQUEST_ID_CHARS:
        return None
    if not all(" " <= ch <= "~" for ch in value):
        return None
    return value


def current_request_id() -> str | None:
    return REQUEST_ID.get()


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The record's request ids and `extra=` fields."""
    out: dict[str, Any] = {}
    request_id = REQUEST_ID.get()
    if request_id is not None:
        out["request_id"] = request_id
    client_id = CLIENT_REQUEST_ID.get()
    if client_id is not None:
        out["client_request_id"] = client_id
    for key, value in record.__dict__.items():
        if key not in _RECORD_ATTRS and not key.startswith("_"):
            out[key] = value  # an explicit field (the access line's request_id) wins
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers (Loki, Elasticsearch, CloudWatch …)."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = int(record.created)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        line: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(fields_of(record))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    """The human line; a record of a request ends with its id, `[req <id>]`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request_id = REQUEST_ID.get()
        if request_id is None:
            return text
        head, sep, tail = text.partition("\n")  # a traceback stays below the line
        return f"{head} [req {request_id}]{sep}{tail}"


class _ReplicaAccessFilter(logging.Filter):
    """uvicorn's access lines in a replica: never for health probes and scrapes (one a second
    per replica), and none at all under a platform, whose gateway logs every request."""

    def __init__(self) -> None:
        super().__init__()
        self.under_platform = bool(os.environ.get(PARENT_PID_ENV))

    def filter(self, record: logging.LogRecord) -> bool:
        if self.under_platform:
            return False
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and str(args[2]).split("?")[0] in _PROBE_PATHS)


def setup_logging(settings: TelemetrySettings, replica: bool = False) -> None:
    """Configure this process's root logger from `settings` (every earlier handler replaced,
    so it may run twice); `replica`: a worker or encoder host (see `_ReplicaAccessFilter`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level.upper())
    quiet = max(logging.WARNING, root.level)
    for name in _NOISY:
        logging.getLogger(name).setLevel(quiet)
    if replica:
        # A logger's filters outlive uvicorn's own logging setup (dictConfig keeps them).
        access = logging.getLogger("uvicorn.access")
        for old_filter in [f for f in access.filters if isinstance(f, _ReplicaAccessFilter)]:
            access.removeFilter(old_filter)
        access.addFilter(_ReplicaAccessFilter())
