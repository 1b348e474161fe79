"""The gateway's request path for inference: authenticate → validate → resolve the model →
rate limit and quota → pick a replica → proxy (streams chunk by chunk) → meter exactly once.

A connection failure before the first byte is retried on another replica with the same request
id; once bytes have flowed the request is never re-sent. Nothing is metered for requests that
fail before a worker served them (bad input, limits, no capacity). What admission holds and how
a request is settled (once, whatever the client does) is `accounting.py`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from modelyard.config import PlatformSettings
from modelyard.core.admission import AdmissionRefused, Waiter, admission_rank
from modelyard.core.errors import DomainError
from modelyard.core.identity import Principal
from modelyard.core.routing import Activate, EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.gateway.accounting import NO_LIMITS, Accounting, Call, take_usage
from modelyard.gateway.async_results import AsyncResults
from modelyard.gateway.auth import Authenticator
from modelyard.gateway.cache_scope import scope_prefix_cache
from modelyard.gateway.metering import UsageEvent, UsageRecorder
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quota import ConcurrencyLimiter, concurrency_beside
from modelyard.gateway.ratelimit import QuotaCounter, RateLimiter
from modelyard.protocol.disconnect import run_until_disconnect
from modelyard.protocol.embeddings import EmbeddingRequest
from modelyard.protocol.errors import APIError, bad_request, error_body, validation_error
from modelyard.protocol.openai import PROMPT_TOKENS_HEADER, ChatCompletionRequest, CompletionRequest
from modelyard.protocol.sse import (
    DATA_PREFIX,
    DONE,
    DONE_EVENT,
    EVENT_END,
    sse_comment,
    sse_data,
    sse_raw,
)

log = logging.getLogger(__name__)

# Told how long a request has waited for a replica that is being started.
Progress = Callable[[float], Awaitable[None]]

# The engine serves lower priorities first: interactive requests get their tenant tier's rank
# (0 priority, 1 standard, 2 free), batch items this plus the rank, after all interactive ones.
# Whatever a client sends is overridden, so nobody jumps the queue.
BATCH_PRIORITY_BASE = 3
_SCHEMAS: dict[str, type[BaseModel]] = {
    "chat.completions": ChatCompletionRequest,
    "completions": CompletionRequest,
    "embeddings": EmbeddingRequest,
}
_PATHS = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}
# Failures before any response byte: the request never reached a model, so another replica may
# take it. (aiohttp measured ~3x less client CPU per proxied request than httpx here.)
_RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError)


def estimate_prompt_tokens(payload: dict[str, Any]) -> int:
    """A cheap upper-ish estimate (4 characters a token) used to reserve TPM before the worker
    counts for real; the reservation is reconciled with the true count afterwards."""
    if "messages" in payload:
        chars = 0
        for m in payload.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(str(p.get("text", ""))) for p in content if isinstance(p, dict))
            chars += 16
        return chars // 4 + 1
    prompt = payload.get("prompt", payload.get("input"))
    if isinstance(prompt, str):
        return len(prompt) // 4 + 1
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, list) else len(str(p)) // 4 + 1 for p in prompt)
    return 1


class _GuardedStream(StreamingResponse):
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


class Gateway:
    def __init__(
        self,
        settings: PlatformSettings,
        auth: Authenticator,
        limiter: RateLimiter,
        quota: QuotaCounter,
        routing: RoutingTable,
        recorder: UsageRecorder,
        metrics: GatewayMetrics,
        slots: ConcurrencyLimiter | None = None,
        activate: Activate | None = None,
    ) -> None:
        self.settings = settings
        # The control plane's verb for scale from zero (None: no endpoint scales from zero).
        self.activate = activate
        self.auth = auth
        self.limiter = limiter
        self.quota = quota
        # Tenants' requests in flight, kept where the quota is (Redis or this process).
        self.slots = slots if slots is not None else concurrency_beside(quota)
        self.routing = routing
        self.recorder = recorder
        self.metrics = metrics
        self.accounting = Accounting(limiter, quota, self.slots, recorder, metrics)
        self.session: aiohttp.ClientSession | None = None
        self.async_results = AsyncResults(settings.async_result_ttl_s)
        self._unary_timeout = aiohttp.ClientTimeout(
            total=settings.gateway_request_timeout_s, connect=settings.gateway_connect_timeout_s
        )
        # A stream's deadline is per read: a model that stops sending for this long is cut.
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None,
            connect=settings.gateway_connect_timeout_s,
            sock_read=settings.gateway_stream_idle_timeout_s,
        )

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1000, limit_per_host=0),
            auto_decompress=False,
        )

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()

    # ----- admission -------------------------------------------------------------------------

    def _parse(self, kind: str, body: bytes) -> tuple[dict[str, Any], Any]:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise bad_request(
                f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
            ) from exc
        if not isinstance(payload, dict):
            raise bad_request("The request body must be a JSON object.", code="invalid_json")
        try:
            return payload, _SCHEMAS[kind].model_validate(payload)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from exc

    async def _admit(
        self, principal: Principal, payload: dict[str, Any], req: Any, kind: str
    ) -> Call:
        """Rate limits, then the quota reservation and a concurrency slot; all or nothing."""
        route = self._resolve(principal, req.model)
        reserved = self._reserve(route, payload, req)
        decision = await self.accounting.acquire(principal, req.model, reserved)
        call = Call(
            principal=principal,
            route=route,
            kind=kind,
            request_id=uuid.uuid4().hex,
            reserved=reserved,
            decision=decision,
        )
        try:
            await self.accounting.hold(call)
        except BaseException as exc:
            await self._refund(call)
            if isinstance(exc, APIError | DomainError):
                exc.headers.update(decision.headers())
            raise
        return call

    def _reserve(self, route: EndpointRoute, payload: dict[str, Any], req: Any) -> int:
        """Tokens to hold against TPM until the real count is known."""
        if isinstance(req, EmbeddingRequest):
            return estimate_prompt_tokens(payload)
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if max_tokens is not None and max_tokens > route.max_tokens_cap:
            raise bad_request(
                f"max_tokens is {max_tokens}, above this model's cap of {route.max_tokens_cap}",
                "max_tokens",
                "invalid_value",
            )
        completion = max_tokens or self.settings.default_reserved_completion_tokens
        prompt = getattr(req, "prompt", None)
        batched = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        n_prompts = len(prompt) if batched else 1
        return estimate_prompt_tokens(payload) + completion * req.n * n_prompts

    def _resolve(self, principal: Principal, model: str) -> EndpointRoute:
        route = self.routing.resolve(principal.tenant_id, model)
        if route is None:
            raise APIError(
                404,
                f"The model `{model}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        return route

    # ----- forwarding ------------------------------------------------------------------------

    async def _replica(
        self, call: Call, tried: set[str], progress: Progress | None = None
    ) -> ReplicaRoute | None:
        """A replica with room for the request, waiting for one if need be.

        No replica serving: if the control plane says none will come up by waiting (the
        endpoint failed, or its replica died and a replacement is starting), a 503 with
        Retry-After at once; else ask it for one (scale from zero, or one still starting) and
        wait up to `scale_from_zero_timeout_s`, reporting progress. All replicas full: wait in
        the endpoint's admission queue (best tier first, see `AdmissionQueue`) up to
        `admission_timeout_s`; a queue full for the request's tier, a better tier taking its
        place, or a wait that runs out is a 429 with Retry-After. None: every replica was tried.
        """
        route, s = call.route, self.settings
        rank = admission_rank(getattr(call.principal, "tier", None), call.batch)
        loop = asyncio.get_running_loop()
        started = loop.time()
        waiter: Waiter | None = None
        try:
            while True:
                if route.queue.may_take(rank, waiter):
                    replica = self.routing.pick(route, tried)
                    if replica is not None:
                        return replica
                if not route.ready_replicas:
                    if waiter is not None:  # nothing to wait for in the queue
                        route.queue.leave(waiter)
                        waiter = None
                    if route.unavailable is not None:
                        raise APIError(
                            503,
                            f"`{route.model_name}` is unavailable: {route.unavailable}. "
                            f"Please retry in {route.retry_after_s}s.",
                            code="model_unavailable",
                            headers={"retry-after": str(route.retry_after_s)},
                        )
                    if tried or self.activate is None:
                        return None
                    self.activate(route.endpoint_id)
                    waited = loop.time() - started
                    if waited > s.scale_from_zero_timeout_s:
                        raise APIError(
                            503,
                            f"`{route.model_name}` is still loading after {waited:.0f}s; retry",
                            code="model_loading",
                            headers={"retry-after": "10"},
                        )
                    if progress is not None:
                        await progress(waited)
                    await route.wait_change(1.0)
                    continue
                if all(r.replica_id in tried for r in route.ready_replicas):
                    return None
                if waiter is None:
                    try:
                        waiter = route.queue.join(rank, s.admission_queue_size)
                    except AdmissionRefused as exc:
                        raise self._overloaded(route, str(exc)) from exc
                    continue  # first in line already: try for a slot before sleeping
                remaining = started + s.admission_timeout_s - loop.time()
                if remaining <= 0:
                    raise self._overloaded(
                        route, f"no replica had room for {s.admission_timeout_s:g}s"
                    )
                await waiter.wait(min(remaining, 1.0))
                if waiter.refused is not None:
                    raise self._overloaded(route, waiter.refused)
        finally:
            if waiter is not None:
                route.queue.leave(waiter)

    def _overloaded(self, route: EndpointRoute, why: str) -> APIError:
        self.metrics.limited.labels("capacity").inc()
        return APIError(
            429,
            f"`{route.model_name}` is at capacity ({why}). Please retry shortly.",
            code="model_overloaded",
            headers={"retry-after": "5"},
        )

    async def _send(
        self,
        call: Call,
        payload: bytes | None,
        stream: bool,
        path: str | None = None,
        progress: Progress | None = None,
    ) -> tuple[aiohttp.ClientResponse, ReplicaRoute]:
        """Open the upstream response, trying other replicas on connection failures."""
        assert self.session is not None
        tried: set[str] = set()
        last_error: Exception | None = None
        for attempt in range(self.settings.gateway_retries + 1):
            replica = await self._replica(call, tried, progress)
            if replica is None:
                break
            tried.add(replica.replica_id)
            replica.outstanding += 1
            try:
                response = await self.session.request(
                    "GET" if payload is None else "POST",
                    replica.url + (path or _PATHS[call.kind]),
                    data=payload,
                    headers={"content-type": "application/json", "x-request-id": call.request_id},
                    timeout=self._stream_timeout if stream else self._unary_timeout,
                )
                return response, replica
            except _RETRYABLE as exc:
                call.route.release(replica)
                replica.breaker.record(ok=False)
                if isinstance(exc, aiohttp.ClientConnectorError):
                    # Nobody listens there: bench it until the control plane's next health
                    # probe finds it answering again.
                    self.routing.bench(replica)
                elif attempt == 0:
                    # The worker closed the connection before answering: a pooled keep-alive
                    # connection it had just closed, or it died with the request. Nothing
                    # reached the client, so the request may go again, there too once.
                    tried.discard(replica.replica_id)
                last_error = exc
                if attempt < self.settings.gateway_retries:
                    self.metrics.retries.inc()
                log.warning("replica %s unreachable (%r); trying another", replica.url, exc)
            except BaseException:
                call.route.release(replica)
                raise
        # The replicas' addresses stay in the log: they are the platform's, not the tenant's.
        log.warning(
            "no replica of %s could take request %s (last error: %r)",
            call.route.endpoint_id, call.request_id, last_error,
        )  # fmt: skip
        raise APIError(
            503,
            f"No replica of `{call.route.model_name}` is available right now. "
            "Please retry shortly.",
            code="no_capacity",
            headers={"retry-after": "5"},
        )

    async def handle(self, request: Request, kind: str) -> Response:
        principal = await self.auth.authenticate(request.headers.get("authorization"))
        principal.require("inference")
        payload, req = self._parse(kind, await request.body())
        call = await self._admit(principal, payload, req, kind)
        route = call.route
        try:
            headers = {"x-request-id": call.request_id, **call.decision.headers()}
            if route.upstream_model:
                payload["model"] = route.upstream_model
            _fill_sampling_defaults(payload, route, kind)
            if kind != "embeddings":
                payload["priority"] = principal.tier.rank
                # Last, so no default and no client value outlives it.
                scope_prefix_cache(payload, self.settings.prefix_cache_scope, principal.tenant_id)
            route.arrive()
            cold = not route.ready_replicas and self.activate is not None
            if getattr(req, "stream", False):
                wants_usage = bool(req.stream_options and req.stream_options.include_usage)
                # Always ask for usage, so the stream can be billed; the client sees the usage
                # chunk only if it asked for it.
                payload["stream_options"] = {"include_usage": True}
                body = orjson.dumps(payload)
                if cold:
                    return self._cold_stream(call, body, wants_usage, headers)
                return await self._stream(call, body, wants_usage, headers)
            body = orjson.dumps(payload)
            if cold and "respond-async" in request.headers.get("prefer", ""):
                return self.async_results.submit(
                    principal.tenant_id, call.request_id, lambda: self._unary(call, body, headers)
                )
            return await run_until_disconnect(request, self._unary(call, body, headers))
        except BaseException:
            # Nothing was served: give the reserved tokens back.
            await self._refund(call)
            raise

    async def run_internal(
        self, principal: Principal, kind: str, payload: dict[str, Any], request_id: str
    ) -> tuple[int, dict[str, Any], UsageEvent | None]:
        """One batch item: the same validation, routing, retries and metering as a client's
        request, without rate limits, at batch priority, metered as batch, never streamed.

        Returns the worker's status and body, and the usage record to commit with the result
        (None unless it succeeded); raises `APIError` for what fails before a worker (bad body,
        unknown model, quota, no replica)."""
        _, req = self._parse(kind, orjson.dumps(payload))
        route = self._resolve(principal, req.model)
        body = {**payload, "stream": False}
        if kind != "embeddings":
            body["priority"] = BATCH_PRIORITY_BASE + principal.tier.rank
        if route.upstream_model:
            body["model"] = route.upstream_model
        _fill_sampling_defaults(body, route, kind)
        if kind != "embeddings":
            scope_prefix_cache(body, self.settings.prefix_cache_scope, principal.tenant_id)
        call = Call(
            principal=principal,
            route=route,
            kind=kind,
            request_id=request_id,
            reserved=0,
            decision=NO_LIMITS,
            batch=True,
        )
        if principal.monthly_token_quota is not None:
            # Held while the item runs, so that concurrent items see each other's share; the
            # runner counts the real use when it commits the item's result.
            call.reserved = self._reserve(route, payload, req)
            await self.accounting.reserve_quota(call)
        try:
            status, content = await self._call_unary(call, orjson.dumps(body))
            result = orjson.loads(content)
            if route.upstream_model and isinstance(result, dict) and "model" in result:
                result["model"] = route.model_name
            if status != 200:
                await self._refund(call)
                return status, result, None
            take_usage(call, result.get("usage") or {})
            return status, result, await self._finish(call)
        except BaseException:
            await self._refund(call)
            raise

    async def _refund(self, call: Call) -> None:
        """Nothing was served: give back what admission held (TPM, quota, slot)."""
        await self.accounting.close(call, served=False)

    async def _finish(self, call: Call) -> UsageEvent | None:
        """Meter a served request: metrics, the TPM and quota settlement, its usage record.

        None only if the request had been refunded already. A batch item's record is returned,
        not queued: the runner commits it together with the item's result, so neither can
        exist without the other.
        """
        return await self.accounting.close(call, served=True)

    async def _call_unary(
        self, call: Call, payload: bytes | None, path: str | None = None
    ) -> tuple[int, bytes]:
        """Send a non-streaming request (a GET without payload) and read the whole answer."""
        response, replica = await self._send(call, payload, stream=False, path=path)
        try:
            content = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            response.close()
            replica.breaker.record(ok=False)
            raise APIError(502, f"the model server failed: {exc!r}", code="upstream_error") from exc
        finally:
            call.route.release(replica)
            response.release()
        replica.breaker.record(ok=response.status < 500)
        call.status_code = response.status
        return response.status, content

    async def _unpaid(self, call: Call, content: bytes, headers: dict[str, str]) -> Response:
        """A worker's own error (already OpenAI-shaped) goes back as it is; nothing is billed."""
        self.metrics.requests.labels(call.route.model_name, call.status_code).inc()
        await self._refund(call)
        return Response(
            content, status_code=call.status_code, media_type="application/json", headers=headers
        )

    async def _unary(self, call: Call, payload: bytes, headers: dict[str, str]) -> Response:
        status, content = await self._call_unary(call, payload)
        if status != 200:
            return await self._unpaid(call, content, headers)
        body = orjson.loads(content)
        take_usage(call, body.get("usage") or {})
        await self._finish(call)
        if call.route.upstream_model:  # the client knows the model by its public name
            body["model"] = call.route.model_name
            content = orjson.dumps(body)
        return Response(content, media_type="application/json", headers=headers)

    # ----- Open Inference Protocol v2 -------------------------------------------------------

    async def handle_oip(self, request: Request, model: str, action: str) -> Response:
        """`/v2/models/{model}[/ready|/infer]` for the tenant's classifier and embedding
        endpoints: same keys, limits and routing; an inference counts one request (and no
        tokens) against the key and in metering."""
        principal = await self.auth.authenticate(request.headers.get("authorization"))
        principal.require("inference")
        route = self._resolve(principal, model)
        upstream = route.upstream_model or route.model_name
        path = f"/v2/models/{upstream}" + (f"/{action}" if action else "")
        if action != "infer":
            call = Call(principal, route, "oip", uuid.uuid4().hex, 0, NO_LIMITS)
            status, content = await self._call_unary(call, None, path)
            return Response(
                self._rename(content, upstream, route.model_name),
                status_code=status,
                media_type="application/json",
            )
        decision = await self.accounting.acquire(principal, model, 0)
        call = Call(principal, route, "oip.infer", uuid.uuid4().hex, 0, decision)
        try:
            await self.accounting.hold(call)
            headers = {"x-request-id": call.request_id, **decision.headers()}
            status, content = await self._call_unary(call, await request.body(), path)
            if status == 200:
                await self._finish(call)
            else:
                self.metrics.requests.labels(route.model_name, status).inc()
        finally:
            await self._refund(call)  # gives back what is held unless metered above
        return Response(
            self._rename(content, upstream, route.model_name),
            status_code=status,
            media_type="application/json",
            headers=headers,
        )

    @staticmethod
    def _rename(content: bytes, upstream: str, public: str) -> bytes:
        if upstream == public:
            return content
        try:
            body = orjson.loads(content)
        except orjson.JSONDecodeError:
            return content
        for key in ("name", "model_name"):
            if isinstance(body, dict) and body.get(key) == upstream:
                body[key] = public
        return orjson.dumps(body)

    async def _stream(
        self, call: Call, payload: bytes, wants_usage: bool, headers: dict[str, str]
    ) -> Response:
        response, replica = await self._send(call, payload, stream=True)
        if response.status != 200:
            try:
                content = await response.read()
            finally:
                response.release()
                call.route.release(replica)
            replica.breaker.record(ok=response.status < 500)
            call.status_code = response.status
            return await self._unpaid(call, content, headers)
        call.prompt_tokens = int(response.headers.get(PROMPT_TOKENS_HEADER, 0))

        async def unstarted() -> None:
            response.close()
            call.route.release(replica)
            await self._refund(call)

        return _GuardedStream(
            self._relay(call, response, replica, wants_usage), call, unstarted, headers
        )

    def _cold_stream(
        self, call: Call, payload: bytes, wants_usage: bool, headers: dict[str, str]
    ) -> StreamingResponse:
        """A stream for a model that is not loaded yet: SSE comment lines report the loading
        while the client waits, then the generation streams as usual. An endpoint that no
        replica will serve by waiting (failed, or a dead replica's replacement starting) gets
        the 503 itself, before any 200 is sent."""
        route = call.route
        if route.unavailable is not None and not route.ready_replicas:
            raise APIError(
                503,
                f"`{route.model_name}` is unavailable: {route.unavailable}. "
                f"Please retry in {route.retry_after_s}s.",
                code="model_unavailable",
                headers={"retry-after": str(route.retry_after_s)},
            )

        async def body() -> AsyncIterator[bytes]:
            notes: asyncio.Queue[bytes] = asyncio.Queue()

            async def progress(waited: float) -> None:
                await notes.put(sse_comment(f"loading {call.route.model_name}, {waited:.0f}s"))

            opening = asyncio.ensure_future(self._send(call, payload, True, progress=progress))
            try:
                while not opening.done():
                    note = asyncio.ensure_future(notes.get())
                    await asyncio.wait({opening, note}, return_when=asyncio.FIRST_COMPLETED)
                    if note.done():
                        yield note.result()
                    else:
                        note.cancel()
                response, replica = opening.result()
            except APIError as exc:
                await self._refund(call)
                yield sse_data(exc.body())
                yield DONE
                return
            finally:
                if not opening.done():
                    opening.cancel()
            if response.status != 200:
                try:
                    content = await response.read()
                finally:
                    response.release()
                    call.route.release(replica)
                await self._refund(call)
                yield sse_raw(content)
                yield DONE
                return
            call.prompt_tokens = int(response.headers.get(PROMPT_TOKENS_HEADER, 0))
            async for chunk in self._relay(call, response, replica, wants_usage):
                yield chunk

        # Until the relay starts nothing was served: a client gone while the model loads (or
        # before the body started) is refunded.
        return _GuardedStream(body(), call, lambda: self._refund(call), headers)

    async def _relay(
        self,
        call: Call,
        response: aiohttp.ClientResponse,
        replica: ReplicaRoute,
        wants_usage: bool,
    ) -> AsyncIterator[bytes]:
        call.relaying = True
        buffer = b""
        complete = False
        delivered = False  # the client has read the final [DONE]
        try:
            async for chunk in response.content.iter_any():
                buffer += chunk
                while EVENT_END in buffer:
                    event, buffer = buffer.split(EVENT_END, 1)
                    if self._inspect(call, event, wants_usage):
                        if event == DONE_EVENT:
                            # Billed (journaled on disk) before the client sees the end.
                            await self._finish(call)
                        yield event + EVENT_END
                        delivered = event == DONE_EVENT
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
            call.route.release(replica)
            replica.breaker.record(ok=call.status != "error")
            await self._finish(call)

    def _inspect(self, call: Call, event: bytes, wants_usage: bool) -> bool:
        """Meter one SSE event; False if it must not reach the client."""
        if not event.startswith(DATA_PREFIX) or event == DONE_EVENT:
            return True
        try:
            obj = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            return True
        if "error" in obj:
            call.status = "error"
            return True
        choices = obj.get("choices") or []
        for choice in choices:
            delta = choice.get("delta") or {}
            if delta.get("content") or choice.get("text"):
                call.completion_tokens += 1
                if call.ttft is None:
                    call.ttft = time.perf_counter() - call.started
        usage = obj.get("usage")
        if usage:
            take_usage(call, usage)
            # The usage-only chunk was asked for by the gateway, not necessarily the client.
            return bool(choices) or wants_usage
        return True


def _fill_sampling_defaults(payload: dict[str, Any], route: EndpointRoute, kind: str) -> None:
    """The endpoint's sampling defaults, for the fields the request left out (or sent as null)."""
    if kind == "embeddings":
        return
    for key, value in route.sampling_defaults.items():
        if payload.get(key) is None:
            payload[key] = value


# The names tests import from here.
_Call = Call
_NO_LIMITS = NO_LIMITS
