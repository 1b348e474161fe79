"""Budgets in dollars at the gateway: which budgets a request falls under (its tenant's, its
key's, its team's), its price, and the spend it reserves and settles.

A request's price is its registry LoRA adapter's when it names one of its tenant's adapters
that has a price (`adapter_prices`, keyed by the tenant and the adapter's name: another tenant's
adapter of the same name is another key), else its endpoint's (`model_prices`), else the
`prices` setting's for the model, else nothing (free). Admission reserves the most the request
can cost (the token bound the quota reserves, every token at that price's highest:
`Price.bound`) on the spend counter of every budget it
falls under, in the budget's current period (day or month, UTC), all at once; it is refused
with a 429 `budget_exceeded` when one of them has reached its limit. Settlement moves the
counters from the reservation to the real cost (a batch item's once its result is committed,
like its quota). So spend passes a limit by at most one request's cost, on one gateway or many
(the counters live where the quota's do: `spend.py`). A request is billed in the period it was
admitted in. A Redis that lost the counters (a restart, a failover) has them rebuilt from the
usage rows before a budget is checked or read again (`spend_rebuild.py`), so a tenant at its
limit stays refused.

Prices and budgets are read from the database every `budget_refresh_s` (a change made through
this process applies at once: `invalidate`). A period's counter crossing a budget's soft limit
is handed to the alert sink (a webhook and an audit event, once per budget and period).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Protocol

from modelyard.config import ModelPrice
from modelyard.core.adapter_routes import AdapterTarget
from modelyard.core.errors import QuotaExceeded
from modelyard.core.identity import Principal
from modelyard.core.pricing import (
    MICRO,
    BudgetPeriod,
    BudgetScope,
    Price,
    period_key,
    period_start,
    usd,
)
from modelyard.core.routing import EndpointRoute
from modelyard.gateway.limits_outage import fail_closed
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quota import QuotaCounter, RedisQuotaCounter
from modelyard.gateway.spend import MemorySpend, RedisSpend, SpendCounter
from modelyard.gateway.spend_rebuild import SpendRebuild
from modelyard.store import budgets as rows
from modelyard.store.db import Database
from modelyard.store.repository import now

log = logging.getLogger(__name__)

_SEEDED_CAP = 100_000

# (tenant id, adapter registry name) → the adapter's own price
AdapterPrices = dict[tuple[str, str], Price]


@dataclass(frozen=True)
class Budget:
    id: str
    tenant_id: str
    scope: BudgetScope
    subject_id: str
    period: BudgetPeriod
    limit_micro: int
    soft_limit_micro: int | None
    webhook_url: str | None

    def counter(self, key: str) -> str:
        return f"{self.id}:{key}"


@dataclass(frozen=True)
class BudgetHold:
    """What a request holds since admission: `micro` on each budget's counter of a period."""

    held: tuple[tuple[Budget, str], ...]  # (budget, period key)
    micro: int
    reserved_on: str = ""  # the run id of the Redis server that took it ("" in memory)


class BudgetRowLike(Protocol):
    id: str
    tenant_id: str
    scope: str
    subject_id: str
    period: str
    limit_micro: int
    soft_limit_micro: int | None
    webhook_url: str | None


class AlertSink(Protocol):
    def crossed(self, budget: Budget, period_key: str, spent_micro: int) -> None:
        """A budget's soft limit was crossed in `period_key` (called at most once per process
        per budget and period; the sink makes it once across processes)."""


def config_price(price: ModelPrice, batch_discount: float) -> Price:
    """A `prices` setting's entry (USD floats per 1M tokens) in micro-dollars."""

    def micro(v: float) -> int:
        return int(Decimal(str(v)) * MICRO)

    return Price(
        input_micro=micro(price.input),
        output_micro=micro(price.output),
        cached_input_micro=None if price.cached_input is None else micro(price.cached_input),
        batch_discount_bps=int(Decimal(str(batch_discount)) * 10_000),
    )


def spend_beside(quota: QuotaCounter) -> SpendCounter:
    """Spend counters kept where the quota is kept: in the same Redis, or in this process."""
    if isinstance(quota, RedisQuotaCounter):
        return RedisSpend(quota.redis)
    return MemorySpend()


class BudgetBook:
    def __init__(
        self,
        db: Database,
        spend: SpendCounter,
        refresh_s: float,
        config_prices: dict[str, ModelPrice],
        batch_discount: float,
        flush: Callable[[], Awaitable[None]] | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        """`flush` writes this process's pending usage rows (before a rebuild reads them);
        `metrics` count the rebuilds of the spend counters this process makes."""
        self.db = db
        self.spend = spend
        self.spend_rebuild = SpendRebuild(spend, self._spent_now, flush, metrics)
        self.refresh_s = refresh_s
        self._config = {m: config_price(p, batch_discount) for m, p in config_prices.items()}
        self._prices: dict[str, Price] = {}
        self._adapter_prices: AdapterPrices = {}
        self._budgets: dict[str, list[Budget]] = {}
        self._loaded_at: float | None = None
        self._loading: asyncio.Task[None] | None = None
        self._seeded: set[str] = set()
        self._alerted: set[str] = set()
        self.sink: AlertSink | None = None

    # ----- what is configured -----------------------------------------------------------------

    def _load(self) -> tuple[dict[str, Price], AdapterPrices, dict[str, list[Budget]]]:
        with self.db.session() as s:
            prices = {p.endpoint_id: price_of(p) for p in rows.all_prices(s)}
            adapters = {(t, name): price_of(p) for t, name, p in rows.all_adapter_prices(s)}
            budgets: dict[str, list[Budget]] = {}
            for b in rows.all_budgets(s):
                budgets.setdefault(b.tenant_id, []).append(budget_of(b))
        return prices, adapters, budgets

    async def _reload(self) -> None:
        try:
            self._prices, self._adapter_prices, self._budgets = await asyncio.to_thread(self._load)
            self._loaded_at = time.monotonic()
        except Exception as exc:  # the database away: the last read stays in force
            log.warning("reading prices and budgets failed (the last read stays): %r", exc)

    async def fresh(self) -> None:
        """The last read, rereading in the background once it is `refresh_s` old (the first
        read, and one after `invalidate`, is waited for)."""
        loaded = self._loaded_at
        if loaded is not None and time.monotonic() - loaded < self.refresh_s:
            return
        if self._loading is None or self._loading.done():
            self._loading = asyncio.create_task(self._reload(), name="budgets-reload")
        if loaded is None:
            await asyncio.shield(self._loading)

    def invalidate(self) -> None:
        """Reread before the next request (a price or budget changed in this process)."""
        self._loaded_at = None

    def price(
        self, route: EndpointRoute, tenant_id: str = "", adapter: AdapterTarget | None = None
    ) -> Price:
        """What a request of `tenant_id` to `route` costs: its adapter's price (the tenant's
        own adapter, as `target_for` resolves it), else the endpoint's, else the setting's."""
        if adapter is not None:
            own = self._adapter_prices.get((tenant_id, adapter.name))
            if own is not None:
                return own
        found = self._prices.get(route.endpoint_id) or self._config.get(route.model_name)
        return found or Price()

    def applicable(self, p: Principal) -> list[Budget]:
        subjects = {BudgetScope.TENANT: p.tenant_id, BudgetScope.KEY: p.key_id}
        if p.team_id is not None:
            subjects[BudgetScope.TEAM] = p.team_id
        return [
            b for b in self._budgets.get(p.tenant_id, ()) if subjects.get(b.scope) == b.subject_id
        ]

    def _spent_now(self) -> dict[str, int]:
        """Every budget's counter of its current period and its spend from the usage rows (what
        a rebuild sets: read from the database, not this process's last read)."""
        at = now()
        with self.db.session() as s:
            found = rows.all_budgets(s)
            spent = rows.spent_in_periods(s, found, at)
        budgets = [budget_of(b) for b in found]
        return {b.counter(period_key(b.period, at)): spent[b.id] for b in budgets}

    # ----- reserve and settle -----------------------------------------------------------------

    async def _seed(self, budget: Budget, key: str) -> None:
        counter = budget.counter(key)
        if counter in self._seeded:
            return
        since = period_start(budget.period, now())

        def spent() -> int:
            with self.db.session() as s:
                return rows.spent_since(s, budget.scope, budget.tenant_id, budget.subject_id, since)

        await self.spend.seed(counter, await asyncio.to_thread(spent))
        if len(self._seeded) >= _SEEDED_CAP:
            self._seeded.clear()  # seeding again is harmless (it never overwrites)
        self._seeded.add(counter)

    async def hold(
        self,
        p: Principal,
        route: EndpointRoute,
        tokens: int,
        batch: bool = False,
        adapter: AdapterTarget | None = None,
    ) -> BudgetHold | None:
        """Reserve the request's most cost (at its adapter's price, else its endpoint's) on
        every budget it falls under; None when none applies (or the model is free);
        `QuotaExceeded` (`budget_exceeded`) when one is spent."""
        await self.fresh()
        budgets = self.applicable(p)
        if not budgets:
            return None
        micro = self.price(route, p.tenant_id, adapter).bound(tokens, batch)
        if micro == 0:  # a free model: nothing to count, nothing to refuse
            return None
        ts = now()
        held = tuple((b, period_key(b.period, ts)) for b in budgets)
        counters = [b.counter(k) for b, k in held]

        async def reserve() -> tuple[int, str]:
            for b, key in held:
                await self._seed(b, key)
            return await self.spend.reserve(counters, [b.limit_micro for b, _ in held], micro)

        with fail_closed():  # counters lost: rebuilt, then tried once more
            refused, reserved_on = await self.spend_rebuild.counted(reserve)
            if refused >= 0:
                (spent,) = await self.spend_rebuild.counted(
                    lambda: self.spend.spent([counters[refused]])
                )
                raise budget_exceeded(held[refused][0], spent)
        return BudgetHold(held, micro, reserved_on)

    async def current(self, budgets: list[Budget]) -> list[tuple[str, int]]:
        """Each budget's current period and its spend (with what requests in flight hold)."""
        ts = now()
        keys = [period_key(b.period, ts) for b in budgets]
        pairs = list(zip(budgets, keys, strict=True))

        async def read() -> list[int]:
            for b, key in pairs:
                await self._seed(b, key)
            return await self.spend.spent([b.counter(k) for b, k in pairs])

        with fail_closed():  # counters lost: rebuilt, then read once more
            spent = await self.spend_rebuild.counted(read)
        return list(zip(keys, spent, strict=True))

    async def settle(self, hold: BudgetHold, cost_micro: int) -> None:
        """Move the hold's counters from its reservation to the real cost (0: given back);
        on counters Redis lost since the reservation, see `RedisSpend.settle`."""
        counters = [b.counter(k) for b, k in hold.held]
        totals = await self.spend.settle(counters, hold.micro, cost_micro, hold.reserved_on)
        if not totals:  # left to the rebuild
            return
        for (budget, key), total in zip(hold.held, totals, strict=True):
            soft = budget.soft_limit_micro
            if soft is not None and total >= soft and cost_micro > 0:
                self._alert(budget, key, total)

    def _alert(self, budget: Budget, key: str, total: int) -> None:
        marker = budget.counter(key)
        if marker in self._alerted or self.sink is None:
            return
        if len(self._alerted) >= _SEEDED_CAP:
            self._alerted.clear()
        self._alerted.add(marker)
        self.sink.crossed(budget, key, total)


_ADJECTIVE = {BudgetPeriod.DAY: "daily", BudgetPeriod.MONTH: "monthly"}


def budget_exceeded(budget: Budget, spent_micro: int) -> QuotaExceeded:
    whose = {
        BudgetScope.TENANT: "your organization's",
        BudgetScope.KEY: "this API key's",
        BudgetScope.TEAM: "your team's",
    }[budget.scope]
    return QuotaExceeded(
        f"You exceeded {whose} {_ADJECTIVE[budget.period]} budget of ${usd(budget.limit_micro)} "
        f"(${usd(spent_micro)} spent or reserved by requests in flight). It starts again next "
        f"{budget.period} (UTC); ask your administrator to raise it.",
        code="budget_exceeded",
    )


class PriceRowLike(Protocol):
    input_micro: int
    output_micro: int
    cached_input_micro: int | None
    batch_discount_bps: int


def price_of(p: PriceRowLike) -> Price:
    """An endpoint's or an adapter's price row as the gateway holds it."""
    return Price(p.input_micro, p.output_micro, p.cached_input_micro, p.batch_discount_bps)


def budget_of(b: BudgetRowLike) -> Budget:
    """A budget row as the gateway holds it."""
    return Budget(
        b.id, b.tenant_id, BudgetScope(b.scope), b.subject_id, BudgetPeriod(b.period),
        b.limit_micro, b.soft_limit_micro, b.webhook_url,
    )  # fmt: skip
