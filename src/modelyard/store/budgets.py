"""The rows behind budgets in dollars: endpoints' and adapters' prices, budgets, the
once-per-period marker of a soft threshold's alert, and the spend of a budget's subject summed
from the usage rows (what a spend counter is seeded with when a gateway first counts a period,
and every budget's at once when the counters are rebuilt: `spent_in_periods`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from modelyard.core.pricing import BudgetPeriod, BudgetScope, period_start
from modelyard.store.budget_tables import AdapterPriceRow, BudgetAlert, BudgetRow, ModelPriceRow
from modelyard.store.repository import now
from modelyard.store.tables import Model, UsageRecord


def all_prices(s: Session) -> Sequence[ModelPriceRow]:
    return s.scalars(select(ModelPriceRow)).all()


def all_adapter_prices(s: Session) -> list[tuple[str, str, AdapterPriceRow]]:
    """Every adapter's price with its tenant and registry name (a price whose adapter is gone
    is left out)."""
    rows = s.execute(
        select(Model.tenant_id, Model.name, AdapterPriceRow).join(
            Model, Model.id == AdapterPriceRow.model_id
        )
    ).all()
    return [(tenant_id, name, row) for tenant_id, name, row in rows]


def drop_adapter_price(s: Session, model_id: str) -> None:
    """The price of a registry model being deleted goes with it."""
    s.execute(delete(AdapterPriceRow).where(AdapterPriceRow.model_id == model_id))


def all_budgets(s: Session) -> Sequence[BudgetRow]:
    return s.scalars(select(BudgetRow)).all()


def budgets_of(s: Session, tenant_id: str | None) -> Sequence[BudgetRow]:
    q = select(BudgetRow)
    if tenant_id is not None:
        q = q.where(BudgetRow.tenant_id == tenant_id)
    return s.scalars(q.order_by(BudgetRow.created_at, BudgetRow.id)).all()


def spent_since(s: Session, scope: str, tenant_id: str, subject_id: str, since: datetime) -> int:
    """Micro-dollars the subject's usage rows cost since `since`."""
    q = select(func.coalesce(func.sum(UsageRecord.cost_micro), 0)).where(
        UsageRecord.tenant_id == tenant_id, UsageRecord.created_at >= since
    )
    if scope == BudgetScope.KEY:
        q = q.where(UsageRecord.key_id == subject_id)
    elif scope == BudgetScope.TEAM:
        q = q.where(UsageRecord.team_id == subject_id)
    return int(s.scalar(q) or 0)


def spent_in_periods(s: Session, budgets: Sequence[BudgetRow], at: datetime) -> dict[str, int]:
    """Each budget's spend (by id) in its period holding `at`: what `spent_since` gives one
    budget from its period's start, for all of them in one query grouped by key, team and
    whether the row is of `at`'s day."""
    tenants = {b.tenant_id for b in budgets}
    if not tenants:
        return {}
    month = period_start(BudgetPeriod.MONTH, at)
    today = UsageRecord.created_at >= period_start(BudgetPeriod.DAY, at)
    u = UsageRecord
    q = (
        select(u.tenant_id, u.key_id, u.team_id, today, func.coalesce(func.sum(u.cost_micro), 0))
        .where(u.tenant_id.in_(tenants), u.created_at >= month)
        .group_by(u.tenant_id, u.key_id, u.team_id, today)
    )
    groups: dict[str, list[tuple[str, str | None, bool, int]]] = {}
    for tenant_id, key_id, team_id, of_today, micro in s.execute(q):
        groups.setdefault(tenant_id, []).append((key_id, team_id, bool(of_today), int(micro or 0)))
    spent: dict[str, int] = {}
    for b in budgets:
        day = b.period == BudgetPeriod.DAY
        spent[b.id] = sum(
            micro
            for key_id, team_id, of_today, micro in groups.get(b.tenant_id, ())
            if (of_today or not day)
            and (b.scope != BudgetScope.KEY or key_id == b.subject_id)
            and (b.scope != BudgetScope.TEAM or team_id == b.subject_id)
        )
    return spent


def claim_alert(s: Session, budget_id: str, period_key: str, spent_micro: int) -> bool:
    """Mark the budget's soft alert sent for the period; False when another process did first."""
    try:
        with s.begin_nested():
            s.add(BudgetAlert(budget_id=budget_id, period_key=period_key,
                              spent_micro=spent_micro, at=now()))  # fmt: skip
    except IntegrityError:
        return False
    return True
