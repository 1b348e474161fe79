"""The tables of prices and budgets in dollars (`core/pricing.py`; rows read and written by
`store/budgets.py`). Part of the schema with `tables.py` (`schema.py` gathers them)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from modelyard.store.tables import Base


class ModelPriceRow(Base):
    """An endpoint's prices in micro-dollars per 1M tokens (`core/pricing.py`), set by the
    platform admin or the endpoint's tenant; an endpoint without a row costs 0."""

    __tablename__ = "model_prices"

    endpoint_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(40), index=True)
    input_micro: Mapped[int] = mapped_column(BigInteger)
    output_micro: Mapped[int] = mapped_column(BigInteger)
    cached_input_micro: Mapped[int | None] = mapped_column(BigInteger)
    batch_discount_bps: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime]


class AdapterPriceRow(Base):
    """A registry LoRA adapter's prices (all its versions), in micro-dollars per 1M tokens,
    set by the platform admin or an admin of the adapter's tenant. Keyed by the adapter's
    registry model id: an adapter deleted and pushed again under its name starts unpriced. A
    call to an adapter without a row costs its base endpoint's price."""

    __tablename__ = "adapter_prices"

    model_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(40), index=True)
    input_micro: Mapped[int] = mapped_column(BigInteger)
    output_micro: Mapped[int] = mapped_column(BigInteger)
    cached_input_micro: Mapped[int | None] = mapped_column(BigInteger)
    batch_discount_bps: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime]


class BudgetRow(Base):
    """A spend limit in micro-dollars per day or month for a tenant, a key or a team."""

    __tablename__ = "budgets"
    __table_args__ = (UniqueConstraint("tenant_id", "scope", "subject_id", "period"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(40), index=True)
    scope: Mapped[str] = mapped_column(String(20))  # tenant | key | team
    subject_id: Mapped[str] = mapped_column(String(40))  # the tenant, key or team id
    period: Mapped[str] = mapped_column(String(20))  # day | month
    limit_micro: Mapped[int] = mapped_column(BigInteger)
    soft_limit_micro: Mapped[int | None] = mapped_column(BigInteger)
    webhook_url: Mapped[str | None] = mapped_column(String(2000))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class BudgetAlert(Base):
    """A budget's soft threshold crossed in one period: the row is the once-only marker."""

    __tablename__ = "budget_alerts"

    budget_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    period_key: Mapped[str] = mapped_column(String(20), primary_key=True)
    spent_micro: Mapped[int] = mapped_column(BigInteger)
    at: Mapped[datetime]
