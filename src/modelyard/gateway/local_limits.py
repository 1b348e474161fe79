"""Admission on this gateway's own share of every limit, for while the limits store (Redis) does
not answer (`redis_outage = fail_open`).

With N live gateways (counted in Redis before the outage: `limits_outage.py`), each admits on
its share of each limit: the key's and the tenant's RPM and TPM, and the tenant's requests in
flight, each `max(1, limit // N)`; the monthly quota's share is what was left of it when Redis
was last seen, `(quota - last known total) // N`. The last known total is the counter this
gateway last read in Redis for the tenant (its admission script returns it), else the month's
usage rows in the database, read once per outage. So N gateways admit together at most
`N × max(1, limit // N)` ≤ `max(limit, N)` a minute (plus what the buckets in Redis had given
out in the minute before the outage: these buckets start full), and the quota is overshot by
at most N requests' reservations, plus whatever other gateways admitted between this one's last
look at the counter and the outage.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime

from modelyard.core.identity import Limits, Principal, TenantLimits
from modelyard.gateway.quota import MemoryConcurrencyLimiter
from modelyard.gateway.ratelimit import Decision, MemoryRateLimiter
from modelyard.store import repository as repo
from modelyard.store.db import Database

# A refusal made before the rate buckets were looked at reports none of them.
_UNCHECKED = Decision(True, None, 0.0, None, None, 0.0, None, None, 0.0)


def share(limit: int | None, gateways: int) -> int | None:
    """One gateway's share of a limit (None: unlimited), never below 1."""
    return None if limit is None else max(1, limit // max(1, gateways))


def shared_limits(limits: Limits, gateways: int) -> Limits:
    """`limits` with every per-minute limit cut to one gateway's share."""
    t = limits.tenant
    tenant = None if t is None else TenantLimits(t.tenant_id, share(t.rpm, gateways),
                                                 share(t.tpm, gateways))  # fmt: skip
    return Limits(share(limits.rpm, gateways), share(limits.tpm, gateways), tenant)


@dataclass(frozen=True)
class LocalAdmitted:
    """A local admission: the rate decision (of the shares), and if that allowed it, whether
    the quota or the concurrency share refused it (`refused`; nothing taken then)."""

    decision: Decision
    refused: str | None
    quota_used: int  # the month's total as this gateway reckons it (for the refusal's message)


class LocalLimits:
    """This gateway's shares of the limits during one outage (see the module's docstring);
    `reset` when Redis answers again."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.known: dict[tuple[str, str], int] = {}  # month totals last seen in Redis
        self.generation = 0
        self.reset()

    def reset(self) -> None:
        """Forget the shares' state: the next outage starts afresh. A request admitted on the
        old state (`generation`) settles nothing here any more."""
        self.generation += 1
        self.limiter = MemoryRateLimiter()
        self.slots = MemoryConcurrencyLimiter()
        self.spent: dict[tuple[str, str], int] = {}  # quota tokens taken here since the outage
        self._floors: dict[str, int] | None = None  # the month's usage rows per tenant

    def saw(self, tenant_id: str, month: str, total: int) -> None:
        """The tenant's month total as Redis reported it at an admission."""
        self.known[(tenant_id, month)] = total

    async def _last_known(self, tenant_id: str, month: str) -> int:
        known = self.known.get((tenant_id, month))
        if known is not None:
            return known
        if self._floors is None:
            self._floors = await asyncio.to_thread(self._load_floors, month)
        return self._floors.get(tenant_id, 0)

    def _load_floors(self, month: str) -> dict[str, int]:
        year, mon = (int(x) for x in month.split("-"))
        with self.db.session() as s:
            return repo.tokens_used_since(s, datetime(year, mon, 1, tzinfo=UTC))

    async def admit(
        self, p: Principal, reserved: int, request_id: str, gateways: int, month: str
    ) -> LocalAdmitted:
        """Check the quota's and the concurrency's shares, then take the rate limits' shares;
        only when all pass is anything taken."""
        limits = shared_limits(p.limits, gateways)
        used = 0
        if p.monthly_token_quota is not None:
            known = await self._last_known(p.tenant_id, month)
            spent = self.spent.get((p.tenant_id, month), 0)
            used = known + spent
            allowance = max(0, p.monthly_token_quota - known) // max(1, gateways)
            if spent >= allowance:
                return LocalAdmitted(_UNCHECKED, "quota", used)
        scope = f"{p.tenant_id}:requests"
        slots = share(p.max_concurrent_requests, gateways)
        if slots is not None and await self.slots.held(scope) >= slots:
            return LocalAdmitted(_UNCHECKED, "concurrency", used)
        decision = await self.limiter.acquire(p.key_id, limits, reserved)
        if not decision.allowed:
            return LocalAdmitted(decision, None, used)
        if slots is not None:
            await self.slots.acquire(scope, request_id, slots)
        if p.monthly_token_quota is not None:
            self.spent[(p.tenant_id, month)] = self.spent.get((p.tenant_id, month), 0) + reserved
        return LocalAdmitted(decision, None, used)

    async def settle(
        self,
        generation: int,
        p: Principal,
        gateways: int,
        tokens_back: int,
        moves: list[tuple[str, int]],
        slot: tuple[str, str] | None,
    ) -> None:
        """A locally admitted request's settlement, on the shares it was admitted on (unless
        they were reset since)."""
        if generation != self.generation:
            return
        if tokens_back:
            await self.limiter.reconcile(
                p.key_id, shared_limits(p.limits, gateways), tokens_back, 0
            )
        for month, tokens in moves:
            self.spent[(p.tenant_id, month)] = self.spent.get((p.tenant_id, month), 0) + tokens
        if slot is not None:
            await self.slots.release(*slot)
