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

With the limits store (Redis) unreachable (`limits_outage.py`), admission goes on this
gateway's shares of each limit (`redis_outage = fail_open`) or fails closed (503), and the
settlements Redis cannot take are journaled and applied once it answers; the usage row is
written either way. With Redis back but its quota counters lost (a restart, a failover), the
first quota check rebuilds them from the usage rows (`quota_rebuild.py`). Budgets in dollars
are held after the rest and settled with it (`budgets.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

from modelyard.core.errors import DomainError, QuotaExceeded, RateLimited
from modelyard.core.identity import Principal
from modelyard.gateway.access_log import logged
from modelyard.gateway.budgets import BudgetBook
from modelyard.gateway.call import Call
from modelyard.gateway.item_usage import ItemUsage
from modelyard.gateway.limits_outage import LimitsOutage, fail_closed, limits_unavailable
from modelyard.gateway.metering import UsageEvent, UsageRecorder, quota_moves
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quota import (
    ConcurrencyLimiter,
    LimitsUnavailable,
    QuotaCounter,
    RedisConcurrencyLimiter,
    RedisQuotaCounter,
    month_of,
)
from modelyard.gateway.quota_rebuild import QuotaRebuild
from modelyard.gateway.ratelimit import Decision, RateLimiter
from modelyard.gateway.ratelimit_redis import RedisAdmission, RedisRateLimiter
from modelyard.gateway.settlement import RedisSettlement, Settlement
from modelyard.store.repository import now

log = logging.getLogger(__name__)


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
        self.at_once: RedisAdmission | None = None
        self.settle_at_once: RedisSettlement | None = None
        if (
            isinstance(limiter, RedisRateLimiter)
            and isinstance(quota, RedisQuotaCounter)
            and isinstance(slots, RedisConcurrencyLimiter)
        ):
            self.at_once = RedisAdmission(limiter, quota, slots)
            self.settle_at_once = RedisSettlement(limiter, quota, slots)
        # With the limits in Redis: what to do while it does not answer (set by the gateway).
        self.outage: LimitsOutage | None = None
        # The quota counters, rebuilt from the usage rows when Redis lost them.
        self.quota_rebuild = QuotaRebuild(quota, recorder, metrics)
        # Budgets in dollars (`budgets.py`): held with the rest, settled with the rest.
        self.budgets: BudgetBook | None = None

    async def hold_budget(self, call: Call) -> None:
        """Reserve the request's most cost on its budgets; refused, everything it holds goes
        back (the caller's admission took the rest already)."""
        if self.budgets is None:
            return
        try:
            p, batch = call.principal, call.batch
            call.budget = await self.budgets.hold(p, call.route, call.reserved, batch, call.adapter)
        except BaseException:
            if not call.batch:
                await self.close(call, served=False)
            raise

    async def admit_at_once(self, call: Call, model: str) -> None:
        """`acquire` and `hold` as one Redis script: the same refusals, and on a refusal
        nothing is held (so the access line is all there is to settle)."""
        assert self.at_once is not None
        p = call.principal
        month = month_of(now())
        outage = self.outage
        if outage is not None and outage.degraded:
            await self._admit_locally(call, model)  # no request waits on a Redis that is away
            return
        at_once = self.at_once
        try:
            admitted = await self.quota_rebuild.counted(lambda: at_once.admit(
                p.key_id, p.limits, call.reserved, p.tenant_id, month, p.monthly_token_quota,
                _slot_scope(p), call.request_id, p.max_concurrent_requests,
            ))  # fmt: skip
        except LimitsUnavailable as exc:
            if outage is None:
                log.warning("refusing a request: %s", exc)
                raise limits_unavailable() from exc
            outage.trip(exc)
            if p.max_concurrent_requests is not None:  # the script may have taken it
                outage.journal_admission(p, (_slot_scope(p), call.request_id), exc)
            await self._admit_locally(call, model)
            return
        call.decision = admitted.decision
        if not admitted.decision.allowed:
            await self.acquire_refused(admitted.decision, model, call.reserved)
        if admitted.refused is not None:
            call.reserved = 0  # nothing taken: the refusal's settlement gives nothing back
            await self.close(call, served=False)
            quota = admitted.refused == "quota"
            refusal: DomainError = (self.quota_exceeded(p, admitted.quota_before) if quota
                                    else self.concurrency_exceeded(p))  # fmt: skip
            refusal.headers.update(admitted.decision.headers())
            raise refusal
        if p.monthly_token_quota is not None:
            call.quota_reserved, call.quota_month = call.reserved, month
            if outage is not None:  # the last known total, for an outage's quota share
                outage.local.saw(p.tenant_id, month, admitted.quota_before + call.reserved)
        call.slot = p.max_concurrent_requests is not None

    async def _admit_locally(self, call: Call, model: str) -> None:
        """Admission while Redis does not answer: on this gateway's shares of each limit
        (fail_open, `local_limits.py`), else a 503."""
        outage = self.outage
        assert outage is not None
        if not outage.fail_open:
            raise limits_unavailable()
        p = call.principal
        month = month_of(now())
        local = await outage.local.admit(p, call.reserved, call.request_id, outage.gateways, month)
        call.decision = local.decision
        if not local.decision.allowed:
            await self.acquire_refused(local.decision, model, call.reserved)
        if local.refused is not None:
            call.reserved = 0  # nothing taken: the refusal's settlement gives nothing back
            await self.close(call, served=False)
            if local.refused == "quota":
                raise self.quota_exceeded(p, local.quota_used)
            raise self.concurrency_exceeded(p)
        self.metrics.local_admissions.inc()
        call.local = outage.local.generation
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
            before = await self.quota_rebuild.counted(
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
                if call.local and self.outage is not None:
                    held = (call.quota_month, call.quota_reserved)
                    await self.outage.settle_locally(call.local, settlement, held, p)
                else:
                    await self._apply(settlement)
            finally:
                await self._settle_budget(call, event, first)
                if event is not None and first:
                    # Journaled last, with nothing awaited between it and the answer leaving:
                    # a crash before it bills an answer that never left, never the reverse,
                    # and one right after it (the answer on its way) is as short as it gets.
                    await self.recorder.write(event)
        return event

    async def _settle_budget(self, call: Call, event: UsageEvent | None, first: bool) -> None:
        """The budgets' counters from the reservation to the real cost (a batch item's stay
        held until `settle_item`; a duplicate report costs nothing)."""
        if call.budget is None or self.budgets is None:
            return
        if event is not None and call.batch:
            return
        cost = (event.cost_micro or 0) if event is not None and first else 0
        await _tolerant(self.budgets.settle(call.budget, cost), "budget settlement")

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
            cost_micro=self._cost(call),
            team_id=p.team_id,
            adapter=call.adapter.ref if call.adapter else None,
        )
        if call.batch:
            # The runner writes the item's row with its result; its quota reservation stays
            # held until then (`settle_item`), so concurrent items keep seeing it.
            return event, False
        first, settlement.quota_moves = self.recorder.claim(
            event, call.quota_reserved, call.quota_month or None
        )
        return event, first

    def _cost(self, call: Call) -> int:
        if self.budgets is None:
            return 0
        price = self.budgets.price(call.route, call.principal.tenant_id, call.adapter)
        return price.cost(call.prompt_tokens, call.cached_tokens, call.completion_tokens,
                          call.batch)  # fmt: skip

    async def settle_item(self, usage: ItemUsage, recorded: bool) -> None:
        """Settle a served batch item's quota once the runner committed its result (and usage
        row: `recorded`) or did not (a revoked key, an item recorded before): the reservation
        held since admission moves to the real count, or goes back. Same settlement as every
        request's (`_apply`)."""
        if usage.budget is not None and self.budgets is not None:
            cost = (usage.event.cost_micro or 0) if recorded else 0
            await _tolerant(self.budgets.settle(usage.budget, cost), "budget settlement")
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
            if self.outage is None:
                await _tolerant(self.settle_at_once.apply(s), "settlement")
            elif self.outage.degraded:  # not sent: journaled whole
                self.outage.journal_settlement(s, None)
            else:
                try:
                    await self.settle_at_once.apply(s)
                except LimitsUnavailable as exc:
                    self.outage.journal_settlement(s, exc)
            return
        if s.moves_tpm:
            await _tolerant(self.limiter.reconcile(s.key_id, s.limits, s.tokens_back, 0), "TPM")
        for month, tokens in s.quota_moves:
            await _tolerant(self.quota.add(s.tenant_id, month, tokens), "quota settlement")
        if s.slot is not None:  # unreleased in Redis, the slot expires with its lease
            await _tolerant(self.slots.release(*s.slot), "slot release")


async def _tolerant(work: Awaitable[Any], what: str) -> None:
    """Bookkeeping after a request must not cost its usage record: with the limits store
    unreachable it is skipped and logged (buckets refill by themselves, slots expire)."""
    try:
        await work
    except LimitsUnavailable as exc:
        log.warning("%s skipped: %s", what, exc)


def _slot_scope(principal: Principal) -> str:
    return f"{principal.tenant_id}:requests"
