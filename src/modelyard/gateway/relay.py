"""Relaying a worker's answer to the client: a unary answer whole, a stream event by event
(metering each event, billing before the final `[DONE]` leaves), a stream for a model still
loading with SSE comments while it waits. A worker's own error goes back as it is, unbilled.

A stream is metered as its events go to the client: each event's token stamp (`protocol.sse`:
the worker's own count of completion tokens when it wrote the event) becomes the request's
completion count before the event is sent, so a client that leaves is billed the tokens that
reached it, whatever they were (text, tool-call arguments, Responses events); the final usage
replaces the count when the stream ends. A worker that stamps nothing (a sidecar runtime) is
metered one token per event that carries output of any kind.

Each path settles the request exactly once, in its own `finally` (`Accounting.close` is
idempotent): a stream's settlement lives in its relay generator, since the response outlives
the handler that returned it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from fastapi.responses import Response, StreamingResponse

from modelyard.config import PlatformSettings
from modelyard.core.errors import DomainError
from modelyard.core.routing import ReplicaRoute
from modelyard.gateway.accounting import Accounting
from modelyard.gateway.call import Call, error_status, take_usage
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.responses_stream import inspect_typed, is_final, is_typed
from modelyard.gateway.upstream import Upstream, not_serving, unavailable
from modelyard.gateway.version_stats import tag_version
from modelyard.protocol.errors import body_of, error_body
from modelyard.protocol.openai import PROMPT_TOKENS_HEADER
from modelyard.protocol.sse import (
    DATA_PREFIX,
    DONE,
    DONE_EVENT,
    EVENT_END,
    read_stamp,
    sse_comment,
    sse_data,
    sse_raw,
)


class GuardedStream(StreamingResponse):
    """A stream that cleans up even if its body never starts (the client left between the
    handler's return and the first chunk): an unstarted generator's `finally` never runs, so
    the slot, the reservations and the upstream connection would be held for good."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        call: Call,
        unstarted: Callable[[], Awaitable[None]],
        headers: dict[str, str],
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
        )
        self._call = call
        self._unstarted = unstarted

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._call.relaying:
                await self._unstarted()


class Relay:
    """Unary and streamed answers back to the client (see the module's docstring)."""

    def __init__(
        self,
        settings: PlatformSettings,
        upstream: Upstream,
        accounting: Accounting,
        metrics: GatewayMetrics,
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.accounting = accounting
        self.metrics = metrics

    async def unpaid(self, call: Call, content: bytes, headers: dict[str, str]) -> Response:
        """A worker's own error (already OpenAI-shaped) goes back as it is; nothing is billed."""
        self.metrics.requests.labels(call.route.model_name, call.status_code).inc()
        await self.accounting.close(call, served=False)
        return Response(
            content, status_code=call.status_code, media_type="application/json", headers=headers
        )

    async def unary(self, call: Call, payload: bytes, headers: dict[str, str]) -> Response:
        status, content = await self.upstream.call_unary(call, payload)
        tag_version(call.version_id, headers)
        if status != 200 and call.prompt_tokens:
            # The engine worked on the prompt before failing (a timeout in prefill): billed for
            # that work, never free, and the client gets the replica's error as it is.
            call.status = "error"
            await self.accounting.close(call, served=True)
            return Response(
                content, status_code=status, media_type="application/json", headers=headers
            )
        if status != 200:
            return await self.unpaid(call, content, headers)
        body = orjson.loads(content)
        take_usage(call, body.get("usage") or {})
        await self.accounting.close(call, served=True)
        if call.adapter is not None:  # the tenant knows its adapter by its registry name
            body["model"] = call.adapter.ref
            content = orjson.dumps(body)
        elif call.route.upstream_model:  # the client knows the model by its public name
            body["model"] = call.route.model_name
            content = orjson.dumps(body)
        return Response(content, media_type="application/json", headers=headers)

    async def stream(
        self, call: Call, payload: bytes, wants_usage: bool, headers: dict[str, str]
    ) -> Response:
        response, replica = await self.upstream.send(call, payload, stream=True)
        tag_version(call.version_id, headers)
        if response.status != 200:
            content = await _read_refusal(call, response, replica)
            unready = not_serving(call, response.status, content)
            if unready is not None:
                raise unready
            replica.breaker.record(ok=response.status < 500)
            self.upstream.stats.record(
                call.route.endpoint_id, replica.version_id, response.status < 500, None
            )
            call.status_code = response.status
            return await self.unpaid(call, content, headers)
        call.prompt_tokens = int(response.headers.get(PROMPT_TOKENS_HEADER, 0))

        async def unstarted() -> None:
            response.close()
            call.route.release(replica, call.batch)
            await self.accounting.close(call, served=False)

        return GuardedStream(
            self._relay(call, response, replica, wants_usage), call, unstarted, headers
        )

    def cold_stream(
        self, call: Call, payload: bytes, wants_usage: bool, headers: dict[str, str]
    ) -> StreamingResponse:
        """A stream for a model that is not loaded yet: SSE comment lines report the loading
        while the client waits, then the generation streams as usual. An endpoint that no
        replica will serve by waiting (failed, or a dead replica's replacement starting) gets
        the 503 itself, before any 200 is sent."""
        route = call.route
        if route.unavailable is not None and not route.ready_replicas:
            raise unavailable(route)

        async def refund() -> None:
            await self.accounting.close(call, served=False)

        async def body() -> AsyncIterator[bytes]:
            notes: asyncio.Queue[bytes] = asyncio.Queue()

            async def progress(waited: float) -> None:
                await notes.put(sse_comment(f"loading {call.route.model_name}, {waited:.0f}s"))

            opening = asyncio.ensure_future(
                self.upstream.send(call, payload, True, progress=progress)
            )
            try:
                while not opening.done():
                    note = asyncio.ensure_future(notes.get())
                    await asyncio.wait({opening, note}, return_when=asyncio.FIRST_COMPLETED)
                    if note.done():
                        yield note.result()
                    else:
                        note.cancel()
                response, replica = opening.result()
            except DomainError as exc:
                # The 200 is sent already: the failure goes to the client as an SSE error event.
                await refund()
                yield sse_data(body_of(exc))
                yield DONE
                return
            finally:
                if not opening.done():
                    opening.cancel()
            if response.status != 200:
                content = await _read_refusal(call, response, replica)
                await refund()
                unready = not_serving(call, response.status, content)
                yield sse_raw(content) if unready is None else sse_data(body_of(unready))
                yield DONE
                return
            call.prompt_tokens = int(response.headers.get(PROMPT_TOKENS_HEADER, 0))
            async for chunk in self._relay(call, response, replica, wants_usage):
                yield chunk

        # Until the relay starts nothing was served: a client gone while the model loads (or
        # before the body started) is refunded.
        return GuardedStream(body(), call, refund, headers)

    async def _relay(
        self,
        call: Call,
        response: aiohttp.ClientResponse,
        replica: ReplicaRoute,
        wants_usage: bool,
    ) -> AsyncIterator[bytes]:
        call.relaying = True
        rename = _adapter_rename(call)
        buffer = b""
        complete = False
        delivered = False  # the client has read the final [DONE]
        try:
            async for chunk in response.content.iter_any():
                buffer += chunk
                while EVENT_END in buffer:
                    event, buffer = buffer.split(EVENT_END, 1)
                    bare = _stamp(call, event)  # the end is known by the event, stamp off
                    if _inspect(call, bare, wants_usage):
                        final = bare == DONE_EVENT or is_final(bare)
                        if final:
                            # Billed (journaled on disk) before the client sees the end.
                            await self.accounting.close(call, served=True)
                        if rename is not None:  # the adapter's registry name, not its internal one
                            event = event.replace(*rename)
                        yield event + EVENT_END
                        delivered = final
            complete = True
        except (TimeoutError, aiohttp.ClientError) as exc:
            call.status = "error"
            idle = self.settings.gateway_stream_idle_timeout_s
            message = (
                f"no data from the model for {idle:g}s"
                if isinstance(exc, TimeoutError)
                else f"the model server failed mid-stream: {exc!r}"
            )
            error = error_body(message, "server_error", None, "upstream_error")
            yield sse_data(error)
            yield DONE
        except (asyncio.CancelledError, GeneratorExit):
            # A client that closes right after [DONE] (before the worker's end of stream
            # reached here) got the whole answer.
            if not delivered:
                call.status = "client_disconnected"
            raise
        finally:
            if complete:
                response.release()
            else:
                # Closing the connection is what tells the worker to abort the generation.
                response.close()
            call.route.release(replica, call.batch)
            replica.breaker.record(ok=call.status != "error")
            self.upstream.stats.record(
                call.route.endpoint_id, replica.version_id, call.status != "error", call.ttft
            )
            await self.accounting.close(call, served=True)


async def _read_refusal(
    call: Call, response: aiohttp.ClientResponse, replica: ReplicaRoute
) -> bytes:
    """A worker's refusal of a stream (its own error body), read whole; the replica's slot
    and the connection go back either way."""
    try:
        return await response.read()
    finally:
        response.release()
        call.route.release(replica, call.batch)


def _stamp(call: Call, event: bytes) -> bytes:
    """Take the event's token stamp as the request's completion count (it goes to the client
    next); the event without the stamp, to inspect."""
    tokens, bare = read_stamp(event)
    if tokens is not None:
        call.stamped = True
        if tokens > call.completion_tokens:
            call.completion_tokens = tokens
            if call.ttft is None:
                call.ttft = time.perf_counter() - call.started
    return bare


# What a chunk's delta may carry of the model's output.
_OUTPUT = ("content", "tool_calls", "function_call", "reasoning_content", "reasoning", "refusal")


def _inspect(call: Call, event: bytes, wants_usage: bool) -> bool:
    """Meter one SSE event (its stamp taken off); False if it must not reach the client."""
    if is_typed(event):  # the Responses API's typed events
        return inspect_typed(call, event)
    if not event.startswith(DATA_PREFIX) or event == DONE_EVENT:
        return True
    try:
        obj = orjson.loads(event[6:])
    except orjson.JSONDecodeError:
        return True
    if "error" in obj:
        call.status = error_status(obj["error"])
        return True
    choices = obj.get("choices") or []
    if not call.stamped:  # an unstamped stream: one token per event with output
        for choice in choices:
            delta = choice.get("delta") or {}
            if choice.get("text") or any(delta.get(k) for k in _OUTPUT):
                call.completion_tokens += 1
                if call.ttft is None:
                    call.ttft = time.perf_counter() - call.started
    usage = obj.get("usage")
    if usage:
        take_usage(call, usage)
        # The usage-only chunk was asked for by the gateway, not necessarily the client.
        return bool(choices) or wants_usage
    return True


def _adapter_rename(call: Call) -> tuple[bytes, bytes] | None:
    """For a registry adapter's stream: the `model` field as the replica writes it (its served
    model's name) and as the tenant knows it (`name:version`)."""
    if call.adapter is None:
        return None
    served = call.route.upstream_model or call.route.model_name
    return f'"model":"{served}"'.encode(), f'"model":"{call.adapter.ref}"'.encode()
