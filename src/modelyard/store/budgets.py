"""The rows behind budgets in dollars: endpoints' and adapters' prices, budgets, the
once-per-period marker of a soft threshold's alert, and the spend of a budget's subject summed
from the usage rows (what a spend counter is seeded with when a gateway first counts a period)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from modelyard.core.pricing import BudgetScope
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


def claim_alert(s: Session, budget_id: str, period_key: str, spent_micro: int) -> bool:
    """Mark the budget's soft alert sent for the period; False when another process did first."""
    try:
        with s.begin_nested():
            s.add(BudgetAlert(budget_id=budget_id, period_key=period_key,
                              spent_micro=spent_micro, at=now()))  # fmt: skip
    except IntegrityError:
        return False
    return True
