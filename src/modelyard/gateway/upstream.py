"""Sending a request upstream: pick a replica with room (waiting in the endpoint's admission
queue, or for a replica the control plane starts from zero), open the connection, and retry
on another replica a failure that happened before the first response byte.

A batch item goes only to a replica that may take it (backfill, `core/backfill.py`: the rule
the batch budget held it back by). While none may, it waits as the budget does, on the
endpoint's change signal and outside the admission queue: it never takes an interactive
request's place there, never counts as queued demand, and never times out into a 429.

Once bytes have flowed a request is never re-sent; the same request id goes with every try.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp
import orjson

from modelyard.config import PlatformSettings
from modelyard.core import tracing
from modelyard.core.admission_queue import AdmissionRefused, Waiter, admission_rank
from modelyard.core.backfill import Backfill, HoldBack
from modelyard.core.cache_routing import CacheHint
from modelyard.core.cluster_auth import replica_headers
from modelyard.core.errors import (
    DomainError,
    RateLimited,
    Unavailable,
    UpstreamFailed,
    model_not_found,
)
from modelyard.core.prefix_keys import HEADER as PREFIX_KEYS_HEADER
from modelyard.core.routing import Activate, EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.gateway.call import Call
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.version_stats import VersionStats
from modelyard.protocol.openai import PROMPT_TOKENS_HEADER
from modelyard.protocol.sse import TOKEN_STAMPS_HEADER

log = logging.getLogger(__name__)

# Told how long a request has waited for a replica that is being started.
Progress = Callable[[float], Awaitable[None]]

_PATHS = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}
_STAMPS = {TOKEN_STAMPS_HEADER: "1"}
# Failures before any response byte: the request never reached a model, so another replica may
# take it. (aiohttp measured ~3x less client CPU per proxied request than httpx here.)
_RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError)
_NOT_SERVING_RETRY_S = 2


def unavailable(route: EndpointRoute) -> Unavailable:
    """The endpoint has no replica serving and none will come up by waiting."""
    return Unavailable(
        f"`{route.model_name}` is unavailable: {route.unavailable}. "
        f"Please retry in {route.retry_after_s}s.",
        code="model_unavailable",
        retry_after_s=route.retry_after_s,
    )


def not_serving(call: Call, status: int, content: bytes) -> DomainError | None:
    """A replica's `404 model_not_found`: the gateway resolved the model, so the replica does
    not serve it yet or any more (an encoder host being restarted or taken over, a replica
    being renamed): the endpoint is only unavailable, a retryable 503, never the client's 404.
    Except for a name of the engine's own `lora_dir` (`Call.folder_model`), which only the
    worker can look up: no such adapter is the client's 404, as for any unknown model."""
    if status != 404:
        return None
    try:
        error = orjson.loads(content).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if not isinstance(error, dict) or error.get("code") != "model_not_found":
        return None
    if call.folder_model is not None:
        return model_not_found(call.folder_model)
    return Unavailable(
        f"`{call.route.model_name}` is not ready on its replica right now (it is being started or "
        f"taken over). Please retry in {_NOT_SERVING_RETRY_S}s.",
        code="model_not_ready",
        retry_after_s=_NOT_SERVING_RETRY_S,
    )


class Upstream:
    """The connection pool to the replicas and the choice of replica (see the docstring)."""

    def __init__(
        self,
        settings: PlatformSettings,
        routing: RoutingTable,
        metrics: GatewayMetrics,
        activate: Activate | None,
    ) -> None:
        self.settings = settings
        self.routing = routing
        self.metrics = metrics
        # The control plane's verb for scale from zero (None: no endpoint scales from zero).
        self.activate = activate
        # Cluster mode: how long to wait for a fresh routing entry when every replica of the
        # entry a request was routed on refused the connection (gone: replaced, or moved).
        self.stale_route_wait_s = 0.0
        self.session: aiohttp.ClientSession | None = None
        # Each version's answers, for the canary's SLO gate (read by the control plane).
        self.stats = VersionStats()
        # Where a batch item may go: the batch budget's own rule (`BatchRunner` builds it alike).
        self.backfill = Backfill.of(settings)
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
            headers=replica_headers(self.settings),  # the token the replicas demand
        )

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def replica(
        self, call: Call, tried: set[str], progress: Progress | None = None
    ) -> ReplicaRoute | None:
        """A replica with room for the request, waiting for one if need be.

        No replica serving: if the control plane says none will come up by waiting (the
        endpoint failed, or its replica died and a replacement is starting), a 503 with
        Retry-After at once; else ask it for one (scale from zero, or one still starting) and
        wait up to `scale_from_zero_timeout_s`, reporting progress. All replicas full: wait in
        the endpoint's admission queue (best tier first, see `AdmissionQueue`) up to
        `admission_timeout_s`; a queue full for the request's tier, a better tier taking its
        place, or a wait that runs out is a 429 with Retry-After. A batch item only takes a
        replica that may take it, and waits for one outside the queue, behind every queued
        request (see the module docstring). None: every replica was tried.
        """
        route, s = call.route, self.settings
        rank = admission_rank(getattr(call.principal, "tier", None), call.batch)
        backfill = self.backfill if call.batch else None
        loop = asyncio.get_running_loop()
        started = loop.time()
        waiter: Waiter | None = None
        hold: HoldBack | None = None
        try:
            while True:
                if route.queue.may_take(rank, waiter):
                    replica = self.routing.pick(route, tried, call.affinity, call.prefix, backfill)
                    if replica is not None:
                        return replica
                if not route.ready_replicas:
                    if waiter is not None:  # nothing to wait for in the queue
                        route.queue.leave(waiter)
                        waiter = None
                    if route.unavailable is not None:
                        raise unavailable(route)
                    if tried or self.activate is None:
                        return None
                    self.activate(route.endpoint_id)
                    waited = loop.time() - started
                    if waited > s.scale_from_zero_timeout_s:
                        raise Unavailable(
                            f"`{route.model_name}` is still loading after {waited:.0f}s; retry",
                            code="model_loading",
                            retry_after_s=10,
                        )
                    if progress is not None:
                        await progress(waited)
                    await route.wait_change(1.0)
                    continue
                if all(r.replica_id in tried for r in route.ready_replicas):
                    return None
                if backfill is not None:
                    hold = hold or HoldBack()
                    await hold.wait(route)
                    continue
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

    def _overloaded(self, route: EndpointRoute, why: str) -> RateLimited:
        # A 429 as OpenAI answers a full model: the client is told to slow down and retry.
        self.metrics.limited.labels("capacity").inc()
        return RateLimited(
            f"`{route.model_name}` is at capacity ({why}). Please retry shortly.",
            code="model_overloaded",
            retry_after_s=5,
        )

    async def send(
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
            replica = await self.replica(call, tried, progress)
            if replica is None and await self._fresh_entry(call, tried, last_error):
                replica = await self.replica(call, tried, progress)
            if replica is None:
                break
            tried.add(replica.replica_id)
            replica.outstanding += 1
            replica.batch_outstanding += call.batch
            call.version_id = replica.version_id
            try:
                # With tracing on: a span until the answer starts, whose traceparent the worker
                # continues (`core.tracing`; nothing is added while it is off).
                attrs = {"replica": replica.replica_id, "attempt": attempt}
                with tracing.span("upstream", "client", attrs):
                    response = await self.session.request(
                        "GET" if payload is None else "POST",
                        replica.url + (path or _PATHS[call.kind]),
                        data=payload,
                        headers={
                            "content-type": "application/json",
                            "x-request-id": call.request_id,
                            # Each streamed event's token count, to bill what the client got.
                            **_STAMPS,
                            **tracing.outbound_headers(),
                            **_prefix_header(call),
                        },
                        timeout=self._stream_timeout if stream else self._unary_timeout,
                    )
                return response, replica
            except _RETRYABLE as exc:
                call.route.release(replica, call.batch)
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
                call.route.release(replica, call.batch)
                raise
        # The replicas' addresses stay in the log: they are the platform's, not the tenant's.
        log.warning(
            "no replica of %s could take request %s (last error: %r)",
            call.route.endpoint_id, call.request_id, last_error,
        )  # fmt: skip
        raise Unavailable(
            f"No replica of `{call.route.model_name}` is available right now. "
            "Please retry shortly.",
            code="no_capacity",
            retry_after_s=5,
        )

    async def _fresh_entry(self, call: Call, tried: set[str], last_error: Exception | None) -> bool:
        """After a replica refused the connection: wait (up to `stale_route_wait_s`) for the
        routing entry to name a ready replica this request has not tried. The request keeps
        its id and its one usage record; nothing of it reached the client yet."""
        if self.stale_route_wait_s <= 0 or not isinstance(last_error, aiohttp.ClientConnectorError):
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.stale_route_wait_s
        while (remaining := deadline - loop.time()) > 0:
            if any(r.ready and r.replica_id not in tried for r in call.route.replicas):
                return True
            await call.route.wait_change(remaining)
        return False

    async def call_unary(
        self, call: Call, payload: bytes | None, path: str | None = None
    ) -> tuple[int, bytes]:
        """Send a non-streaming request (a GET without payload) and read the whole answer."""
        response, replica = await self.send(call, payload, stream=False, path=path)
        try:
            content = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            response.close()
            replica.breaker.record(ok=False)
            self.stats.record(call.route.endpoint_id, replica.version_id, False, None)
            failed = f"the model server failed: {exc!r}"
            raise UpstreamFailed(failed, code="upstream_error") from exc
        finally:
            call.route.release(replica, call.batch)
            response.release()
        if response.status != 200:
            unready = not_serving(call, response.status, content)
            if unready is not None:
                raise unready
            # A refusal reports the prompt tokens the engine worked on before it failed (a
            # timeout in prefill); 0 when nothing was done. A success's usage says it instead.
            call.prompt_tokens = _reported_tokens(response.headers.get(PROMPT_TOKENS_HEADER))
        replica.breaker.record(ok=response.status < 500)
        ok, latency = response.status < 500, time.perf_counter() - call.started
        self.stats.record(call.route.endpoint_id, replica.version_id, ok, latency)
        call.status_code = response.status
        return response.status, content


def _prefix_header(call: Call) -> dict[str, str]:
    """The request's prefix keys, for the replica to tie to its KV blocks (cache routing)."""
    if isinstance(call.prefix, CacheHint):
        return {PREFIX_KEYS_HEADER: call.prefix.header()}
    return {}


def _reported_tokens(value: str | None) -> int:
    """A replica's token count header as a number (a trusted component, but never negative)."""
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0
