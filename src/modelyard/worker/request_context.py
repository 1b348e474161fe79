"""A worker request's context: the gateway's request id and trace, through to the engine.

`WorkerRequestContext` (ASGI middleware) takes the gateway's `x-request-id` (validated: 1-128
printable characters, else a new id, which then replaces the header for the serving code that
reads it and derives the engine's request ids from it), puts it in the logs' contextvar, so
that the worker's and the engine's lines for the request carry it, echoes it back, and logs one
line per API request at DEBUG (the gateway's access line is the INFO record of a request).
With tracing on, each request is a server span, a child of the gateway's through
`traceparent`, and `TracedEngine` adds the engine's part as a child span with events: `queued`,
`first_token` (the prompt's prefill done: prompt and cached tokens), `finished` or `aborted`
(finish reasons, tokens). The engine's steps run in its own thread; when a request's prompt is
first scheduled is not reported to the event loop, so prefill has no event of its own.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import nullcontext
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelyard.core import tracing
from modelyard.core.logs import REQUEST_ID, valid_request_id
from modelyard.engine.client import EngineClient, RequestOutput, SamplingParams

log = logging.getLogger("modelyard.worker.requests")

REQUEST_ID_HEADER = b"x-request-id"
# Probes and scrapes: no line, no span, no id (they are a line per second per replica).
_QUIET_PATHS = frozenset({"/health", "/metrics"})


def _headers(scope: Scope) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in scope.get("headers", []):
        if key in (REQUEST_ID_HEADER, b"traceparent"):
            out[key.decode()] = value.decode("latin-1")
    return out


class WorkerRequestContext:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in _QUIET_PATHS:
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        request_id = valid_request_id(headers.get("x-request-id")) or uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)
        # The serving code reads the header: it sees the checked id (or the one made here).
        scope = {
            **scope,
            "headers": [h for h in scope.get("headers", []) if h[0] != REQUEST_ID_HEADER]
            + [(REQUEST_ID_HEADER, request_id.encode())],
        }
        method, path = scope.get("method", ""), scope.get("path", "")
        started = time.perf_counter()
        status: list[int] = []
        try:
            with (
                tracing.span(
                    f"worker {method} {path}",
                    "server",
                    {"http.request.method": method, "url.path": path, "request_id": request_id},
                    parent=headers,
                )
                if tracing.enabled()
                else nullcontext()
            ) as current:

                async def send_with_id(message: Message) -> None:
                    if message["type"] == "http.response.start":
                        status.append(int(message.get("status", 0)))
                        tracing.set_attributes(current, {"http.response.status_code": status[0]})
                        out = [h for h in message.get("headers", []) if h[0] != REQUEST_ID_HEADER]
                        out.append((REQUEST_ID_HEADER, request_id.encode()))
                        message = {**message, "headers": out}
                    await send(message)

                await self.app(scope, receive, send_with_id)
        finally:
            log.debug(
                "%s %s %s in %.1f ms",
                method, path, status[0] if status else "-", (time.perf_counter() - started) * 1000,
                extra={"status_code": status[0] if status else None},
            )  # fmt: skip
            REQUEST_ID.reset(token)


class TracedEngine:
    """The `EngineClient` as the serving code sees it, with each `generate` an `engine` span
    (installed only while tracing is on; everything else is the engine's own)."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        attributes = {"engine.request_id": request_id, "prompt_tokens": len(prompt_token_ids)}
        # Not made current: between yields an async generator runs in its consumer's context.
        current = tracing.start_span("engine", attributes)
        tracing.add_event(current, "queued", {"priority": priority})
        first, last = True, None
        error: BaseException | None = None
        try:
            async for out in self._engine.generate(
                prompt_token_ids, params, request_id, priority, cache_salt
            ):
                if first and any(d.token_ids for d in out.deltas):
                    first = False
                    tracing.add_event(
                        current,
                        "first_token",
                        {"prompt_tokens": out.prompt_tokens, "cached_tokens": out.cached_tokens},
                    )
                last = out
                yield out
        except Exception as exc:
            error = exc
            raise
        finally:
            deltas = last.deltas if last is not None else []
            reasons = [d.finish_reason.value for d in deltas if d.finish_reason is not None]
            tracing.add_event(
                current,
                "finished" if last is not None and last.finished else "aborted",
                {
                    "completion_tokens": None if last is None else last.completion_tokens,
                    "finish_reasons": ",".join(reasons) or None,
                },
            )
            tracing.end_span(current, error)


def traced(engine: EngineClient) -> EngineClient:
    """The engine the serving code should use: itself, or with spans while tracing is on."""
    return TracedEngine(engine) if tracing.enabled() else engine
