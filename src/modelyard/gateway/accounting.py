"""What a request holds between admission and settlement, and the settlement itself.

Admission takes, all or nothing: the key's rate limits (a request and its reserved tokens:
the most it can use, `reservation.py`), the tenant's monthly quota (the same reservation,
atomically: since a reservation is never below the real count, a burst overshoots by at most
one request's reservation) and a slot under the tenant's ceiling on requests in flight.
Settlement happens exactly once per request, whichever comes first: metering (metrics, TPM and
quota settled to the real count, the usage record) when a worker served it, or the refund of
everything held when none did (a batch item's quota stays held until the runner commits its
result: `settle_item`). It runs in a task of the usage recorder's, so a client that
disconnects cancels its wait, never the settlement; the slot is released in the same `finally`.

With the limits store (Redis) unreachable, admission fails closed (503) and settlement skips
and logs the bookkeeping it cannot do, but still writes the usage row. With Redis back but its
quota counters lost (a restart, a failover), the first quota check rebuilds them from the usage
rows before it checks (`quota_rebuild.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from modelyard.core.errors import DomainError, QuotaExceeded, RateLimited, Unavailable
from modelyard.core.identity import Limits, Principal
from modelyard.core.prefix_affinity import PrefixHint
from modelyard.core.routing import EndpointRoute
from modelyard.gateway.access_log import logged
from modelyard.gateway.metering import UsageEvent, UsageRecorder, quota_moves
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quota import (
    ConcurrencyLimiter,
    LimitsUnavailable,
    QuotaCounter,
    QuotaCountersLost,
    RedisConcurrencyLimiter,
    RedisQuotaCounter,
    month_of,
)
from modelyard.gateway.quota_rebuild import QuotaRebuild
from modelyard.gateway.ratelimit import Decision, RateLimiter
from modelyard.gateway.ratelimit_redis import RedisAdmission, RedisRateLimiter
from modelyard.gateway.settlement import RedisSettlement, Settlement
from modelyard.protocol.errors import GRAMMAR_FAILED
from modelyard.store.repository import now

log = logging.getLogger(__name__)
T = TypeVar("T")

NO_LIMITS = Decision(
    allowed=True,
    reason=None,
    retry_after_s=0.0,
    limit_requests=None,
    remaining_requests=None,
    reset_requests_s=0.0,
    limit_tokens=None,
    remaining_tokens=None,
    reset_tokens_s=0.0,
)


@dataclass
class Call:
    """Everything one proxied request accumulates on its way."""

    principal: Principal
    route: EndpointRoute
    kind: str
    request_id: str
    reserved: int
    decision: Decision
    started: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    status: str = "ok"
    status_code: int = 200
    batch: bool = False  # a batch item: no rate limits, metered as batch
    quota_reserved: int = 0  # monthly quota tokens held since admission
    quota_month: str = ""  # the month they are held in
    slot: bool = False  # holds one of the tenant's concurrent-request slots
    # The settlement (metering or refund), once started: runs to its end whatever the client does.
    closing: asyncio.Task[UsageEvent | None] | None = None
    relaying: bool = False  # the stream's relay has started (and will settle in its `finally`)
    stamped: bool = False  # its stream's events carry the worker's token counts
    # Which version serves it (the replica picked: a canary or the stable one), and the key that
    # keeps a user or session on one version while the weights stay (its `user`, x-session-id).
    version_id: str | None = None
    affinity: str | None = None
    prefix: PrefixHint | None = None  # where its prompt prefix is likely cached (several replicas)


def error_status(error: Any) -> str:
    """A usage row's status for an error a replica sent mid-stream: `error` (the replica
    failed: its circuit breaker counts it) or `invalid_request` (the request's own fault, e.g.
    its grammar: the replica is fine)."""
    if not isinstance(error, dict):
        return "error"
    if error.get("type") == "invalid_request_error" or error.get("code") == GRAMMAR_FAILED:
        return "invalid_request"
    return "error"


class Accounting:
    """Admission's holds and the settlement of each request (see the module's docstring)."""

    def __init__(
        self,
        limiter: RateLimiter,
        quota: QuotaCounter,
        slots: ConcurrencyLimiter,
        recorder: UsageRecorder,
        metrics: GatewayMetrics,
    ) -> None:
        self.limiter = limiter
        self.quota = quota
        self.slots = slots
        self.recorder = recorder
        self.metrics = metrics
        # All three in one Redis: admission takes one round trip (`admit_at_once`), and so
        # does settlement.
        in_one_redis = (
            isinstance(limiter, RedisRateLimiter)
            and isinstance(quota, RedisQuotaCounter)
            and isinstance(slots, RedisConcurrencyLimiter)
        )
        self.at_once = RedisAdmission(limiter, quota, slots) if in_one_redis else None
        self.settle_at_once = RedisSettlement(limiter, quota, slots) if in_one_redis else None
        # The quota counters, rebuilt from the usage rows when Redis lost them.
        self.quota_rebuild = QuotaRebuild(quota, recorder)

    async def _counted(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt` (a quota check), once more after rebuilding the counters if Redis lost
        them (`quota_rebuild.py`); a second loss, or a failed rebuild, fails closed."""
        try:
            return await attempt()
        except QuotaCountersLost:
            await self.quota_rebuild.rebuild()
            return await attempt()

    async def admit_at_once(self, call: Call, model: str) -> None:
        """`acquire` and `hold` as one Redis script: the same refusals, and on a refusal
        nothing is held (so the access line is all there is to settle)."""
        assert self.at_once is not None
        p = call.principal
        month = month_of(now())
        at_once = self.at_once
        with fail_closed():
            admitted = await self._counted(lambda: at_once.admit(
                p.key_id, p.limits, call.reserved, p.tenant_id, month, p.monthly_token_quota,
                _slot_scope(p), call.request_id, p.max_concurrent_requests,
            ))  # fmt: skip
        call.decision = admitted.decision
        if not admitted.decision.allowed:
            await self.acquire_refused(admitted.decision, model, call.reserved)
        if admitted.refused is not None:
            call.reserved = 0  # nothing taken: the refusal's settlement gives nothing back
            await self.close(call, served=False)
            if admitted.refused == "quota":
                exc: DomainError = self.quota_exceeded(p, admitted.quota_before)
            else:
                exc = self.concurrency_exceeded(p)
            exc.headers.update(admitted.decision.headers())
            raise exc
        if p.monthly_token_quota is not None:
            call.quota_reserved, call.quota_month = call.reserved, month
        call.slot = p.max_concurrent_requests is not None

    async def hold(self, call: Call) -> None:
        """Reserve the request's tokens against the monthly quota (like TPM: settled to the
        real count afterwards, given back on failure) and take a tenant concurrency slot."""
        p = call.principal
        if p.monthly_token_quota is not None:
            await self.reserve_quota(call)
        if p.max_concurrent_requests is not None:
            with fail_closed():
                taken = await self.slots.acquire(
                    _slot_scope(p), call.request_id, p.max_concurrent_requests
                )
            if not taken:
                raise self.concurrency_exceeded(p)
            call.slot = True

    def concurrency_exceeded(self, principal: Principal) -> RateLimited:
        self.metrics.limited.labels("concurrency").inc()
        return RateLimited(
            f"Too many requests in flight for your organization: the limit is "
            f"{principal.max_concurrent_requests} concurrent requests. Retry when one finishes.",
            code="concurrency_limit_exceeded",
            retry_after_s=1,
        )

    async def acquire(self, principal: Principal, model: str, reserved: int) -> Decision:
        with fail_closed():
            decision = await self.limiter.acquire(principal.key_id, principal.limits, reserved)
        if not decision.allowed:
            await self.acquire_refused(decision, model, reserved)
        return decision

    async def acquire_refused(self, decision: Decision, model: str, reserved: int) -> None:
        """Raise the rate-limit refusal of `decision` for a request reserving `reserved`."""
        if not decision.allowed:
            self.metrics.limited.labels(decision.reason or "limit").inc()
            what = "requests" if decision.reason == "requests" else "tokens"
            limit = decision.limit_requests if what == "requests" else decision.limit_tokens
            message = (
                f"Rate limit reached for {model} on {what} per minute: limit {limit}. "
                f"Please try again in {decision.retry_after_s:.2f}s."
            )
            if what == "tokens" and limit is not None and reserved > limit:
                message = (
                    f"Request too large for {model}: it may use up to {reserved} tokens (its "
                    f"prompt's size in bytes plus max_tokens x n), above your limit of {limit} "
                    "tokens per minute. Lower max_tokens or shorten the prompt."
                )
            raise RateLimited(message, code="rate_limit_exceeded", headers=decision.headers())

    async def reserve_quota(self, call: Call) -> None:
        p = call.principal
        assert p.monthly_token_quota is not None
        month = month_of(now())
        with fail_closed():
            quota = p.monthly_token_quota
            before = await self._counted(
                lambda: self.quota.reserve(p.tenant_id, month, call.reserved, quota)
            )
            if before is None:
                raise self.quota_exceeded(p, await self.quota.used(p.tenant_id, month))
        call.quota_reserved, call.quota_month = call.reserved, month

    def quota_exceeded(self, principal: Principal, used: int) -> QuotaExceeded:
        self.metrics.limited.labels("quota").inc()
        return QuotaExceeded(
            f"You exceeded your monthly token quota ({used} of {principal.monthly_token_quota} "
            "tokens used or reserved by requests in flight). Ask your administrator to raise it.",
            code="insufficient_quota",
        )

    async def close(self, call: Call, served: bool) -> UsageEvent | None:
        """Settle the request once, whichever of metering or refund comes first, in a task the
        client's disconnect cannot cancel (awaiting it may be cancelled; the work goes on)."""
        if call.closing is None:
            # Its access line is logged once it is settled (tokens and latency known).
            call.closing = self.recorder.settle(logged(call, served, self._settle(call, served)))
        return await asyncio.shield(call.closing)

    async def _settle(self, call: Call, served: bool) -> UsageEvent | None:
        p = call.principal
        # What the limits store must change, applied whatever happens before: the slot is
        # released even if metering fails.
        settlement = Settlement(p.key_id, p.limits, p.tenant_id)
        if call.slot:
            settlement.slot = (_slot_scope(p), call.request_id)
        event: UsageEvent | None = None
        first = False
        try:
            if served:
                event, first = self._meter(call, settlement)
            else:
                if call.status_code >= 400:  # the replica's own error answer
                    r = call.route
                    self.metrics.answered(
                        r.endpoint_id, r.model_name, p.tenant_id, call.status_code
                    )
                if not call.batch:
                    settlement.tokens_back = call.reserved  # TPM refunded
                if call.quota_reserved:
                    settlement.quota_moves.append((call.quota_month, -call.quota_reserved))
        finally:
            try:
                await self._apply(settlement)
            finally:
                if event is not None and first:
                    # Journaled last, with nothing awaited between it and the answer leaving:
                    # a crash before it bills an answer that never left, never the reverse,
                    # and one right after it (the answer on its way) is as short as it gets.
                    await self.recorder.write(event)
        return event

    def _meter(self, call: Call, settlement: Settlement) -> tuple[UsageEvent, bool]:
        """The served request's usage event and whether the gateway writes its row (its first
        report, not a batch item's); its metrics counted and its TPM and quota settlement
        added to `settlement`."""
        latency = time.perf_counter() - call.started
        model = call.route.model_name
        p = call.principal
        self.metrics.requests.labels(model, call.status_code).inc()
        self.metrics.served(
            call.route.endpoint_id, model, p.tenant_id, latency, call.ttft,
            call.prompt_tokens, call.completion_tokens, call.status_code,
        )  # fmt: skip
        used = call.prompt_tokens + call.completion_tokens
        if call.reserved and used > call.reserved:  # a template past reservation.py's margins
            log.warning(
                "request %s used %d tokens > reserved %d", call.request_id, used, call.reserved
            )
        if not call.batch:  # TPM settled to the real count
            settlement.tokens_back = call.reserved - used
        event = UsageEvent(
            request_id=call.request_id,
            tenant_id=p.tenant_id,
            key_id=p.key_id,
            endpoint_id=call.route.endpoint_id,
            model=model,
            version_id=call.version_id or call.route.version_id,
            kind=call.kind,
            prompt_tokens=call.prompt_tokens,
            completion_tokens=call.completion_tokens,
            cached_tokens=call.cached_tokens,
            latency_ms=latency * 1000,
            ttft_ms=None if call.ttft is None else call.ttft * 1000,
            status_code=call.status_code,
            status=call.status,
            batch=call.batch,
        )
        if call.batch:
            # The runner writes the item's row with its result; its quota reservation stays
            # held until then (`settle_item`), so concurrent items keep seeing it.
            return event, False
        first, settlement.quota_moves = self.recorder.claim(
            event, call.quota_reserved, call.quota_month or None
        )
        return event, first

    async def settle_item(self, usage: ItemUsage, recorded: bool) -> None:
        """Settle a served batch item's quota once the runner committed its result (and usage
        row: `recorded`) or did not (a revoked key, an item recorded before): the reservation
        held since admission moves to the real count, or goes back. Same settlement as every
        request's (`_apply`)."""
        held = usage.held
        if held is None:
            return
        event = usage.event
        settlement = Settlement(held.key_id, held.limits, held.tenant_id)
        used = event.total_tokens if recorded else 0
        settlement.quota_moves = quota_moves(
            held.tokens, held.month, used, month_of(event.created_at)
        )
        await self._apply(settlement)

    async def _apply(self, s: Settlement) -> None:
        """One round trip when the three live in one Redis; else each through its own."""
        if self.settle_at_once is not None:
            await _tolerant(self.settle_at_once.apply(s), "settlement")
            return
        if s.moves_tpm:
            await _tolerant(self.limiter.reconcile(s.key_id, s.limits, s.tokens_back, 0), "TPM")
        for month, tokens in s.quota_moves:
            await _tolerant(self.quota.add(s.tenant_id, month, tokens), "quota settlement")
        if s.slot is not None:
            # Unreleased in Redis, the slot expires with its lease.
            await _tolerant(self.slots.release(*s.slot), "slot release")


@dataclass(frozen=True)
class QuotaHold:
    """Monthly quota tokens a served batch item still holds (in `month`) until its result is
    committed."""

    tenant_id: str
    key_id: str
    limits: Limits
    month: str
    tokens: int


@dataclass(frozen=True)
class ItemUsage:
    """A served batch item's usage record, and the quota it holds until `settle_item`."""

    event: UsageEvent
    held: QuotaHold | None


def item_usage(call: Call, event: UsageEvent) -> ItemUsage:
    p = call.principal
    held = None
    if call.quota_reserved:
        held = QuotaHold(p.tenant_id, p.key_id, p.limits, call.quota_month, call.quota_reserved)
    return ItemUsage(event, held)


def take_usage(call: Call, usage: dict[str, Any]) -> None:
    # Chat and completions name them prompt/completion tokens, the Responses API input/output.
    call.prompt_tokens = int(
        usage.get("prompt_tokens", usage.get("input_tokens", call.prompt_tokens))
    )
    call.completion_tokens = int(
        usage.get("completion_tokens", usage.get("output_tokens", call.completion_tokens))
    )
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    call.cached_tokens = int(details.get("cached_tokens") or 0)


@contextlib.contextmanager
def fail_closed() -> Iterator[None]:
    """Admission while the limits store (Redis) is unreachable: refused with a 503, never let
    through unlimited and unmetered."""
    try:
        yield
    except LimitsUnavailable as exc:
        log.warning("refusing a request: %s", exc)
        raise Unavailable(
            "Rate limits and quotas cannot be checked right now; please retry shortly.",
            code="limits_unavailable",
            retry_after_s=5,
        ) from exc


async def _tolerant(work: Awaitable[Any], what: str) -> None:
    """Bookkeeping after a request must not cost its usage record: with the limits store
    unreachable it is skipped and logged (buckets refill by themselves, slots expire)."""
    try:
        await work
    except LimitsUnavailable as exc:
        log.warning("%s skipped: %s", what, exc)


def _slot_scope(principal: Principal) -> str:
    return f"{principal.tenant_id}:requests"
