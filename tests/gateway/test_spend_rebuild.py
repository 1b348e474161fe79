"""The budgets' spend counters that survive Redis (`gateway/spend_rebuild.py`), on a private
`redis-server` this test kills and restarts empty, through the real budget book, Redis counters
and usage rows: a budget at its limit stays refused and its spend reads the same after the
restart; a settlement across the loss never leaves a counter below what was spent (nor below
zero); several gateways rebuild once; a rebuild that cannot read the usage rows refuses with a
503, never admits against an empty counter; and the rebuild's one grouped query gives each
budget what seeding it alone does, on SQLite and PostgreSQL. (Through `modelyard serve`:
`tests/platform/test_budget_redis_restart.py`.)"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from datetime import timedelta

import pytest
from redis.asyncio import Redis

from modelyard.core.errors import QuotaExceeded, Unavailable
from modelyard.core.identity import Limits, Principal
from modelyard.core.pricing import BudgetPeriod, BudgetScope, period_key, period_start
from modelyard.core.routing import EndpointRoute
from modelyard.gateway.budgets import BudgetBook, BudgetHold
from modelyard.gateway.redis_connect import open_redis
from modelyard.gateway.spend import RedisSpend
from modelyard.store import budgets as rows
from modelyard.store.budget_tables import BudgetRow, ModelPriceRow
from modelyard.store.db import Database
from modelyard.store.repository import now
from modelyard.store.tables import UsageRecord
from tests.chaos_harness import RedisServer
from tests.conftest import free_port
from tests.databases import fresh_postgres

ROUTE = EndpointRoute("ep-1", "tn-1", "m", False, None, 64)
KEY_LIMIT, TENANT_LIMIT = 1_000, 1_000_000  # micro-dollars: the key's day, the tenant's month
CALLER = Principal("k-1", "k-1", "tn-1", "acme", frozenset({"inference"}), Limits(None, None),
                   None, False)  # fmt: skip


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer.running() as s:  # its own redis-server: these tests kill it
        yield s


@pytest.fixture
def priced(database: Database) -> Database:
    """$1 per 1M tokens (a token costs 1 micro-dollar); the key's daily budget and its tenant's
    monthly one; 600 micro-dollars the key spent earlier today."""
    at = now()
    with database.session() as s:
        s.add(ModelPriceRow(endpoint_id="ep-1", tenant_id="tn-1", input_micro=1_000_000,
                            output_micro=1_000_000, cached_input_micro=None,
                            batch_discount_bps=0, updated_at=at))  # fmt: skip
        for id_, scope, subject, period, limit in (
            ("bdg-key", "key", "k-1", "day", KEY_LIMIT),
            ("bdg-tenant", "tenant", "tn-1", "month", TENANT_LIMIT),
        ):
            s.add(BudgetRow(id=id_, tenant_id="tn-1", scope=scope, subject_id=subject,
                            period=period, limit_micro=limit, soft_limit_micro=None,
                            webhook_url=None, created_at=at, updated_at=at))  # fmt: skip
    write_row(database, "r-0", 600)
    return database


def write_row(
    db: Database, request_id: str, cost: int, key_id: str = "k-1", team_id: str | None = None,
    tenant_id: str = "tn-1", days_ago: int = 0,
) -> None:  # fmt: skip
    """A served request's usage row (what the gateway's recorder writes after settling)."""
    with db.session() as s:
        s.add(UsageRecord(request_id=request_id, tenant_id=tenant_id, key_id=key_id,
                          endpoint_id="ep-1", model="m", version_id=None,
                          kind="chat.completions", prompt_tokens=cost, completion_tokens=0,
                          cached_tokens=0, latency_ms=1.0, ttft_ms=None, status_code=200,
                          status="ok", batch=False, created_at=now() - timedelta(days=days_ago),
                          cost_micro=cost, team_id=team_id))  # fmt: skip


@dataclasses.dataclass
class Gateway:
    """One gateway's budget book over the real Redis, as the proxy builds it."""

    redis: Redis
    book: BudgetBook

    @classmethod
    def start(cls, url: str, db: Database) -> Gateway:
        redis = open_redis(url, 1.0)
        return cls(redis, BudgetBook(db, RedisSpend(redis), 60.0, {}, 0.0))

    async def serve(self, request_id: str, tokens: int, cost: int) -> None:
        """A request held on its budgets, settled at `cost`, its usage row written."""
        hold = await self.book.hold(CALLER, ROUTE, tokens)
        assert hold is not None
        await self.book.settle(hold, cost)
        write_row(self.book.db, request_id, cost)

    async def spent(self) -> dict[str, int]:
        """The key's and the tenant's budget spend, as `GET /v1/budgets` reads it."""
        await self.book.fresh()
        budgets = self.book.applicable(CALLER)
        current = await self.book.current(budgets)
        return {b.id: micro for b, (_, micro) in zip(budgets, current, strict=True)}


async def test_a_budget_at_its_limit_stays_refused_after_redis_restarts_empty(
    server: RedisServer, priced: Database
) -> None:
    g = Gateway.start(server.url, priced)
    try:
        await g.serve("r-1", 300, 250)  # 850 of 1,000 spent
        await g.serve("r-2", 300, 200)  # 1,050: the key's budget is spent
        with pytest.raises(QuotaExceeded):
            await g.book.hold(CALLER, ROUTE, 100)
        assert await g.spent() == {"bdg-key": 1_050, "bdg-tenant": 1_050}
        rebuilds = g.book.spend_rebuild.rebuilds  # 1: the first hold found no marker
        server.kill()
        server.start()
        assert await g.redis.dbsize() == 0
        # Before the fix: the counter started again from 0 (this process had seeded it once),
        # and the key was admitted up to another 1,000.
        with pytest.raises(QuotaExceeded) as refused:
            await g.book.hold(CALLER, ROUTE, 100)
        assert refused.value.code == "budget_exceeded"
        assert "$0.00105 spent" in str(refused.value)
        assert await g.spent() == {"bdg-key": 1_050, "bdg-tenant": 1_050}
        assert g.book.spend_rebuild.rebuilds == rebuilds + 1
    finally:
        await g.redis.aclose()


async def test_a_settlement_across_the_loss_leaves_what_was_spent(
    server: RedisServer, priced: Database
) -> None:
    """Settled before the rebuild, nothing moves (the counter Redis lost would go to -200 and
    hand the key its budget back); the rebuild counts the row. Settled after a rebuild, the
    whole cost is added (the lost reservation is not given back, the row was not rebuilt)."""
    g = Gateway.start(server.url, priced)
    spend = g.book.spend
    assert isinstance(spend, RedisSpend)
    counter = spend.key(f"bdg-key:{period_key(BudgetPeriod.DAY, now())}")
    try:
        early = await g.book.hold(CALLER, ROUTE, 300)
        late = await g.book.hold(CALLER, ROUTE, 300)
        assert isinstance(early, BudgetHold) and isinstance(late, BudgetHold)
        assert await g.spent() == {"bdg-key": 1_200, "bdg-tenant": 1_200}
        server.kill()
        server.start()
        await g.book.settle(early, 100)
        assert await g.redis.get(counter) is None  # not -200
        write_row(priced, "r-early", 100)
        assert await g.spent() == {"bdg-key": 700, "bdg-tenant": 700}  # rebuilt: 600 + 100
        await g.book.settle(late, 50)
        write_row(priced, "r-late", 50)
        assert await g.spent() == {"bdg-key": 750, "bdg-tenant": 750}  # not 450
        await g.serve("r-3", 100, 100)  # on the rebuilt counters: reserved, then settled
        assert await g.spent() == {"bdg-key": 850, "bdg-tenant": 850}
        assert g.book.spend_rebuild.rebuilds == 2
    finally:
        await g.redis.aclose()


async def test_gateways_rebuild_once(server: RedisServer, priced: Database) -> None:
    gateways = [Gateway.start(server.url, priced) for _ in range(3)]
    try:
        await gateways[0].serve("r-1", 300, 300)  # 900 spent
        server.kill()
        server.start()
        # Three gateways, three holds of 40 each, all at once after the restart: one rebuild,
        # and admitted while the key's counter is below 1,000 (all three: 900, 940, 980).
        holds = await asyncio.gather(
            *(g.book.hold(CALLER, ROUTE, 40) for g in gateways for _ in range(2))
        , return_exceptions=True)  # fmt: skip
        rebuilt = [g.book.spend_rebuild.rebuilds for g in gateways]
        assert sum(rebuilt) == 2, rebuilt  # the first hold's, and one after the restart
        assert sum(isinstance(h, BudgetHold) for h in holds) == 3, holds
        assert all(isinstance(h, QuotaExceeded) for h in holds if not isinstance(h, BudgetHold))
        assert await gateways[1].spent() == {"bdg-key": 1_020, "bdg-tenant": 1_020}
    finally:
        for g in gateways:
            await g.redis.aclose()


async def test_a_rebuild_without_the_usage_rows_refuses_with_a_503(
    server: RedisServer, priced: Database
) -> None:
    """Counters lost and the database unreachable: the spend cannot be known, so the request
    is refused as while Redis is down (retryable 503), not admitted against an empty counter."""
    g = Gateway.start(server.url, priced)
    try:
        await g.serve("r-1", 300, 450)  # 1,050: spent
        await g.book.fresh()  # the budgets read while the database answered
        server.kill()
        server.start()
        g.book.db = Database(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none")
        with pytest.raises(Unavailable) as refused:
            await g.book.hold(CALLER, ROUTE, 100)
        assert refused.value.code == "limits_unavailable"
        assert isinstance(g.book.spend, RedisSpend)
        assert not await g.book.spend.marker.built()
        g.book.db.dispose()
    finally:
        await g.redis.aclose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_rebuilds_grouped_query_gives_what_seeding_each_budget_does(
    database: Database, backend: str
) -> None:
    if backend == "postgresql":
        with fresh_postgres() as url:
            db = Database(url)
            try:
                db.migrate()
                compare_spend(db)
            finally:
                db.dispose()
    else:
        compare_spend(database)


def compare_spend(db: Database) -> None:
    at = now()
    month_start, day_start = (period_start(p, at) for p in (BudgetPeriod.MONTH, BudgetPeriod.DAY))
    # Rows today, earlier this month (when today is not its first day), last month, another
    # tenant's; of two keys, one in a team, one row without a cost.
    earlier = (at - month_start).days if day_start > month_start else 0
    for i, (key, team, tenant, days_ago, cost) in enumerate([
        ("k-1", None, "tn-1", 0, 11), ("k-2", "team-a", "tn-1", 0, 13),
        ("k-2", "team-a", "tn-1", earlier, 17), ("k-1", None, "tn-1", earlier, 19),
        ("k-1", None, "tn-1", 40, 23), ("k-3", "team-a", "tn-2", 0, 29),
        ("k-2", "team-a", "tn-1", 0, 0),
    ]):  # fmt: skip
        write_row(db, f"g-{i}", cost, key, team, tenant, days_ago)
    with db.session() as s:
        for scope, subject in (("tenant", "tn-1"), ("key", "k-1"), ("key", "k-2"),
                               ("team", "team-a"), ("key", "k-9")):  # fmt: skip
            for period in ("day", "month"):
                s.add(BudgetRow(id=f"b-{scope}-{subject}-{period}", tenant_id="tn-1",
                                scope=scope, subject_id=subject, period=period,
                                limit_micro=1, soft_limit_micro=None, webhook_url=None,
                                created_at=at, updated_at=at))  # fmt: skip
    with db.session() as s:
        found = rows.all_budgets(s)
        grouped = rows.spent_in_periods(s, found, at)
        one_by_one = {
            b.id: rows.spent_since(s, BudgetScope(b.scope), b.tenant_id, b.subject_id,
                                   period_start(BudgetPeriod(b.period), at))
            for b in found
        }  # fmt: skip
    assert grouped == one_by_one
    assert grouped["b-team-team-a-day"] == 13 and grouped["b-key-k-9-month"] == 0
