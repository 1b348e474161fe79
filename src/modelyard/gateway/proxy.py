"""The gateway's request path for inference, in its four steps:

  admit (auth, parse, resolve, limits, quota: `admission.py`) → send upstream (pick, queue,
  scale from zero, retry before the first byte: `upstream.py`) → relay (unary or stream:
  `relay.py`) → settle exactly once (metering or refund: `accounting.py`).

Nothing is metered for requests that fail before a worker served them (bad input, limits, no
capacity). The batch path (`run_internal`) and the Open Inference Protocol (`oip_proxy.py`)
take the same steps.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from modelyard.config import PlatformSettings
from modelyard.core.adapter_affinity import AdapterHint, adapter_hint
from modelyard.core.adapter_routes import AdapterTarget
from modelyard.core.cache_routing import CacheHint
from modelyard.core.identity import Principal
from modelyard.core.prefix_keys import prefix_keys
from modelyard.core.routing import Activate, EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.gateway.accounting import Accounting
from modelyard.gateway.admission import (
    BATCH_PRIORITY_BASE,
    Admission,
    folder_adapter,
    parse,
    shape_for_worker,
    validate,
)
from modelyard.gateway.async_results import AsyncResults
from modelyard.gateway.auth import Authenticator
from modelyard.gateway.budgets import BudgetBook, spend_beside
from modelyard.gateway.call import NO_LIMITS, Call, take_usage
from modelyard.gateway.item_usage import ItemUsage, item_usage
from modelyard.gateway.limits_outage import LimitsOutage
from modelyard.gateway.local_limits import LocalLimits
from modelyard.gateway.metering import UsageRecorder
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.oip_proxy import OipProxy
from modelyard.gateway.quota import (
    ConcurrencyLimiter,
    RedisConcurrencyLimiter,
    RedisQuotaCounter,
    concurrency_beside,
)
from modelyard.gateway.ratelimit import QuotaCounter, RateLimiter
from modelyard.gateway.relay import Relay
from modelyard.gateway.settlement_journal import SettlementJournal
from modelyard.gateway.upstream import Upstream
from modelyard.protocol.disconnect import run_until_disconnect


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
        self.auth = auth
        # Read by the batch runner: which model an item names, and where its usage is counted.
        self.routing = routing
        self.recorder = recorder
        # Tenants' requests in flight, kept where the quota is (Redis or this process).
        slots = slots if slots is not None else concurrency_beside(quota)
        self.accounting = Accounting(limiter, quota, slots, recorder, metrics)
        self.accounting.budgets = BudgetBook(
            recorder.db, spend_beside(quota), settings.budget_refresh_s, settings.prices,
            settings.batch_discount, recorder.flush, metrics,
        )  # fmt: skip
        if self.accounting.at_once is not None and isinstance(slots, RedisConcurrencyLimiter):
            # Limits in Redis: what admission and settlement do while it does not answer.
            assert isinstance(quota, RedisQuotaCounter)
            self.accounting.outage = LimitsOutage(
                quota,
                SettlementJournal(recorder.db, quota, slots),
                LocalLimits(recorder.db),
                metrics,
                settings.redis_outage,
            )
        self.admission = Admission(settings, routing, self.accounting)
        self.upstream = Upstream(settings, routing, metrics, activate)
        self.relay = Relay(settings, self.upstream, self.accounting, metrics)
        self.oip = OipProxy(auth, self.admission, self.accounting, self.upstream, metrics)
        self.async_results = AsyncResults(settings.async_result_ttl_s)

    async def start(self) -> None:
        await self.upstream.start()
        self.auth.start()  # its keys' last use, written in the background
        if self.accounting.outage is not None:
            await self.accounting.outage.start()

    async def stop(self) -> None:
        await self.upstream.stop()
        await self.auth.stop()
        if self.accounting.outage is not None:
            await self.accounting.outage.stop()

    def _prefix(
        self,
        payload: dict[str, Any],
        kind: str,
        route: EndpointRoute,
        adapter: AdapterTarget | None,
    ) -> CacheHint | AdapterHint | None:
        """For a registry adapter, its name: its requests go where it is loaded (bounded load);
        else the prompt's prefix keys (`core/prefix_keys.py`): the replica holding the longest
        cached prefix takes it (`core/cache_routing.py`). Keyed with one replica too, so that
        its cache is known when a second one comes."""
        s = self.settings
        if adapter is not None:
            if len(route.replicas) < 2:
                return None
            return adapter_hint(adapter.internal, s.prefix_routing_load_factor)
        if not s.prefix_aware_routing:
            return None
        keys = prefix_keys(payload, kind)
        return CacheHint(keys, s.cache_routing_load_factor) if keys is not None else None

    async def _replica(self, call: Call, tried: set[str]) -> ReplicaRoute | None:
        """The replica choice alone (the admission queue's tests drive it directly)."""
        return await self.upstream.replica(call, tried)

    async def handle(self, request: Request, kind: str) -> Response:
        principal = await self.auth.authenticate(request.headers.get("authorization"))
        principal.require("inference")
        payload, req = parse(kind, await request.body())
        call = await self.admission.admit(principal, payload, req, kind)
        # Keeps a session (else a user) on one version of a canaried endpoint.
        call.affinity = request.headers.get("x-session-id") or getattr(req, "user", None)
        route = call.route
        try:
            headers = {"x-request-id": call.request_id, **call.decision.headers()}
            call.adapter = shape_for_worker(
                payload, route, kind, principal, self.settings.prefix_cache_scope,
                principal.tier.rank,
            )  # fmt: skip
            call.folder_model = folder_adapter(route, req.model, call.adapter)
            call.prefix = self._prefix(payload, kind, route, call.adapter)
            route.arrive()
            cold = not route.ready_replicas and self.upstream.activate is not None
            if getattr(req, "stream", False):
                wants_usage = bool(req.stream_options and req.stream_options.include_usage)
                # Always ask for usage, so the stream can be billed; the client sees the usage
                # chunk only if it asked for it.
                payload["stream_options"] = {"include_usage": True}
                body = orjson.dumps(payload)
                if cold:
                    return self.relay.cold_stream(call, body, wants_usage, headers)
                return await self.relay.stream(call, body, wants_usage, headers)
            body = orjson.dumps(payload)
            if cold and "respond-async" in request.headers.get("prefer", ""):
                return self.async_results.submit(
                    principal.tenant_id,
                    call.request_id,
                    lambda: self.relay.unary(call, body, headers),
                )
            return await run_until_disconnect(request, self.relay.unary(call, body, headers))
        except BaseException:
            # Nothing was served: give the reserved tokens back.
            await self.accounting.close(call, served=False)
            raise

    async def run_internal(
        self, principal: Principal, kind: str, payload: dict[str, Any], request_id: str
    ) -> tuple[int, dict[str, Any], ItemUsage | None]:
        """One batch item: the same validation, routing, retries and metering as a client's
        request, without rate limits, at batch priority, metered as batch, never streamed.

        Returns the worker's status and body, and the usage record to commit with the result
        with the quota it still holds (None unless it succeeded: then the runner passes it to
        `settle_item` once the result is committed, or not); raises a `DomainError` for what fails
        before a worker (bad body, unknown model, quota, no replica)."""
        req = validate(kind, payload)
        route = self.admission.resolve(principal, req.model, kind)
        # Embeddings have no stream field (and refuse unknown ones); the rest must not stream.
        body = dict(payload) if kind == "embeddings" else {**payload, "stream": False}
        adapter = shape_for_worker(
            body, route, kind, principal, self.settings.prefix_cache_scope,
            BATCH_PRIORITY_BASE + principal.tier.rank,
        )  # fmt: skip
        call = Call(principal, route, kind, request_id, 0, NO_LIMITS, batch=True, adapter=adapter)
        call.folder_model = folder_adapter(route, req.model, adapter)
        call.prefix = self._prefix(body, kind, route, adapter)
        if principal.monthly_token_quota is not None:
            # Held while the item runs, so that concurrent items see each other's share, and
            # settled to the real use once the runner has committed the item's result.
            call.reserved = self.admission.reserve(route, payload, req)
            await self.accounting.reserve_quota(call)
        try:
            if self.accounting.budgets is not None:  # held like the quota, settled with it
                call.reserved = call.reserved or self.admission.reserve(route, payload, req)
                await self.accounting.hold_budget(call)
            status, content = await self.upstream.call_unary(call, orjson.dumps(body))
            result = orjson.loads(content)
            if route.upstream_model and isinstance(result, dict) and "model" in result:
                result["model"] = route.model_name
            if adapter is not None and isinstance(result, dict) and "model" in result:
                result["model"] = adapter.ref
            if status != 200 and not call.prompt_tokens:
                await self.accounting.close(call, served=False)
                return status, result, None
            if status != 200:
                # The engine worked on the prompt before failing (a timeout in prefill): billed
                # for that work like an API call's (`Relay.unary`), never free.
                call.status = "error"
            else:
                take_usage(call, result.get("usage") or {})
            # A batch item's record is returned, not queued: the runner commits it together
            # with the item's result, so neither can exist without the other.
            event = await self.accounting.close(call, served=True)
            return status, result, None if event is None else item_usage(call, event)
        except BaseException:
            await self.accounting.close(call, served=False)
            raise

    async def settle_item(self, usage: ItemUsage, recorded: bool) -> None:
        """A batch item's quota settled once its result is committed (`recorded`) or not."""
        await self.accounting.settle_item(usage, recorded)

    async def handle_oip(self, request: Request, model: str, action: str) -> Response:
        return await self.oip.handle(request, model, action)
