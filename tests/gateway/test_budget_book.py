"""Money arithmetic and the gateway's budget book on a real database and real spend counters
(in memory; the Redis counters run in `test_budgets.py`): costs are exact integers rounded up
once, a reservation is never below the cost whatever the split of its tokens, a team's budget
binds only its team's keys, and a restarted gateway starts from the spend its rows recorded."""

from __future__ import annotations

import asyncio

import pytest

from modelyard.core.adapter_routes import AdapterTarget
from modelyard.core.errors import QuotaExceeded
from modelyard.core.identity import Limits, Principal
from modelyard.core.pricing import Price, parse_percent_bps, parse_usd, usd
from modelyard.core.routing import EndpointRoute
from modelyard.gateway.budgets import BudgetBook
from modelyard.gateway.spend import MemorySpend
from modelyard.store import repository as repo
from modelyard.store.budget_tables import AdapterPriceRow, BudgetRow, ModelPriceRow
from modelyard.store.db import Database
from modelyard.store.tables import Model, UsageRecord


def test_costs_are_exact_and_reservations_bound_them() -> None:
    price = Price(input_micro=150_000, output_micro=600_000, batch_discount_bps=5_000)
    assert price.cost(10, 0, 5) == 5  # 1.5 + 3.0 micro-dollars, rounded up once
    assert price.cost(10, 0, 5, batch=True) == 3  # half of 4.5, rounded up
    assert Price(1_000_000, 2_000_000, cached_input_micro=0).cost(10, 4, 1) == 8
    for prompt in range(0, 40, 7):
        for completion in range(0, 40, 9):
            for batch in (False, True):
                bound = price.bound(prompt + completion, batch)
                assert price.cost(prompt, 0, completion, batch) <= bound
    assert parse_usd("0.15", "x", 10**9) == 150_000 and parse_usd(2, "x", 10**9) == 2_000_000
    for bad in ("0.0000001", "-1", "NaN", "1e999999999", "x", True):
        with pytest.raises(ValueError):
            parse_usd(bad, "x", 10**9)
    assert parse_usd("12", "x", 10**9) == 12_000_000 and parse_usd(0.5, "x", 10**9) == 500_000
    # Only a plain decimal: no underscore ("5_0" is not $50), space, exponent, sign, other
    # scripts' digits, and no lone point; the refusal names the field.
    for bad in ("5_0", "1_000.5", " 5", "5 ", "5\n", "5e1", "5E1", "+5", "-0", "\u0665", "5.",
                ".5", "0x5", "", "1.2.3", "Infinity"):  # fmt: skip
        with pytest.raises(ValueError, match=r"^limit_usd must be a plain decimal"):
            parse_usd(bad, "limit_usd", 10**9)
        with pytest.raises(ValueError, match=r"^batch_discount_percent must be a plain decimal"):
            parse_percent_bps(bad, "batch_discount_percent")
    assert parse_percent_bps("12.5", "p") == 1_250 and parse_percent_bps(100, "p") == 10_000
    for bad_percent in ("100.01", "0.001", -1, 101.0, True):
        with pytest.raises(ValueError, match=r"^p must be"):
            parse_percent_bps(bad_percent, "p")
    assert (usd(1_500_000), usd(150_000), usd(0)) == ("1.5", "0.15", "0")


def principal(key_id: str, team_id: str | None) -> Principal:
    return Principal(key_id, key_id, "tn-1", "acme", frozenset({"inference"}), Limits(None, None),
                     None, False, team_id=team_id)  # fmt: skip


def test_a_team_budget_binds_its_keys_and_survives_a_restart(database: Database) -> None:
    at = repo.now()
    with database.session() as s:
        s.add(BudgetRow(id="bdg-1", tenant_id="tn-1", scope="team", subject_id="team-a",
                        period="day", limit_micro=1_000, soft_limit_micro=None, webhook_url=None,
                        created_at=at, updated_at=at))  # fmt: skip
        # 600 micro-dollars the team spent earlier today (another key of it).
        s.add(UsageRecord(request_id="r-0", tenant_id="tn-1", key_id="k-0", endpoint_id="ep-1",
                          model="m", version_id=None, kind="chat.completions", prompt_tokens=1,
                          completion_tokens=1, cached_tokens=0, latency_ms=1.0, ttft_ms=None,
                          status_code=200, status="ok", batch=False, created_at=at,
                          cost_micro=600, team_id="team-a"))  # fmt: skip
    route = EndpointRoute("ep-1", "tn-1", "m", False, None, 64)
    with database.session() as s:
        s.add(ModelPriceRow(endpoint_id="ep-1", tenant_id="tn-1", input_micro=1_000_000,
                            output_micro=1_000_000, cached_input_micro=None,
                            batch_discount_bps=0, updated_at=at))  # fmt: skip

    async def run() -> None:
        book = BudgetBook(database, MemorySpend(), 60.0, {}, 0.0)
        member, outsider = principal("k-1", "team-a"), principal("k-2", None)
        hold = await book.hold(member, route, 300)  # reserves 300: 600 + 300 < 1000
        assert hold is not None and hold.micro == 300
        await book.settle(hold, 250)
        hold = await book.hold(member, route, 300)  # 850 < 1000: admitted, may end at 1150
        assert hold is not None
        await book.settle(hold, 200)
        with pytest.raises(QuotaExceeded) as info:  # 1050 spent: refused
            await book.hold(member, route, 1)
        assert info.value.code == "budget_exceeded" and "team's daily budget" in str(info.value)
        assert await book.hold(outsider, route, 300) is None  # no budget of its own
        (current,) = await book.current(book.applicable(member))
        assert current[1] == 1_050

    asyncio.run(run())


def test_a_call_naming_an_adapter_is_reserved_at_the_adapters_price(database: Database) -> None:
    """The hold, not only the bill: an adapter priced 5x its base reserves 5x, for its own
    tenant only (another tenant's adapter of the same name reserves at the base's price)."""
    at = repo.now()
    with database.session() as s:
        for tenant in ("tn-1", "tn-2"):
            repo.create_tenant(s, tenant, None)
        tenant_ids = [t.id for t in repo.list_tenants(s)]
    own, other = sorted(tenant_ids)
    with database.session() as s:
        s.add(Model(id="mdl-bot", tenant_id=own, name="bot", created_at=at))
        s.add(Model(id="mdl-bot-2", tenant_id=other, name="bot", created_at=at))
        s.add(AdapterPriceRow(model_id="mdl-bot", tenant_id=own, input_micro=5_000_000,
                              output_micro=5_000_000, cached_input_micro=None,
                              batch_discount_bps=0, updated_at=at))  # fmt: skip
        s.add(ModelPriceRow(endpoint_id="ep-1", tenant_id="system", input_micro=1_000_000,
                            output_micro=1_000_000, cached_input_micro=None,
                            batch_discount_bps=0, updated_at=at))  # fmt: skip
        for tenant in (own, other):
            s.add(BudgetRow(id=f"bdg-{tenant}", tenant_id=tenant, scope="tenant",
                            subject_id=tenant, period="day", limit_micro=10**9,
                            soft_limit_micro=None, webhook_url=None, created_at=at,
                            updated_at=at))  # fmt: skip
    route = EndpointRoute("ep-1", "system", "m", True, None, 64)
    bot = AdapterTarget("bot", 1, "x.mv-1")

    def caller(tenant_id: str) -> Principal:
        return Principal("k", "k", tenant_id, "acme", frozenset({"inference"}),
                         Limits(None, None), None, False)  # fmt: skip

    async def run() -> None:
        book = BudgetBook(database, MemorySpend(), 60.0, {}, 0.0)
        base = await book.hold(caller(own), route, 100)
        adapter = await book.hold(caller(own), route, 100, adapter=bot)
        theirs = await book.hold(caller(other), route, 100, adapter=bot)
        assert base is not None and adapter is not None and theirs is not None
        assert (base.micro, adapter.micro, theirs.micro) == (100, 500, 100)

    asyncio.run(run())
