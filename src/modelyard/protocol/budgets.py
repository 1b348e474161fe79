"""Request bodies of the prices and budgets API, validated at the edge: unknown fields refused,
every string bounded. Dollar amounts are numbers or decimal strings (at most 6 decimals: the
unit is a micro-dollar); the control plane turns them into exact integers."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StringConstraints

# A dollar amount as sent: a JSON number, or a decimal string ("0.15"); never a boolean (strict
# numbers: `true` is not read as $1).
Dollars = Annotated[str, StringConstraints(max_length=32)] | StrictInt | StrictFloat

ID_MAX = 64


class PriceSet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_usd_per_million: Dollars = Field(0, description="USD per 1M prompt tokens.")
    output_usd_per_million: Dollars = Field(0, description="USD per 1M completion tokens.")
    cached_input_usd_per_million: Dollars | None = Field(
        None, description="USD per 1M prompt tokens served from the prefix cache (default: input)."
    )
    batch_discount_percent: Dollars = Field(
        0, description="Cut on batch items' cost, 0-100 (at most 2 decimals)."
    )


BudgetScopeName = Literal["tenant", "key", "team"]
BudgetPeriodName = Literal["day", "month"]


class BudgetCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: BudgetScopeName = Field(description="tenant, key or team: whose spend it bounds.")
    subject_id: str | None = Field(
        None, min_length=1, max_length=ID_MAX, description="The key or team id (key/team scope)."
    )
    period: BudgetPeriodName = Field("month", description="day or month (UTC).")
    limit_usd: Dollars = Field(description="Hard limit: requests get 429 budget_exceeded.")
    soft_limit_usd: Dollars | None = Field(
        None, description="Soft threshold: one webhook alert and audit event per period."
    )
    webhook_url: str | None = Field(None, max_length=2000, description="Where the alert goes.")
    tenant_id: str | None = Field(
        None, max_length=ID_MAX, description="Platform admin only: whose budget this is."
    )


class BudgetUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    limit_usd: Dollars | None = None
    soft_limit_usd: Dollars | None = Field(None, description="null: no soft threshold.")
    webhook_url: str | None = Field(None, max_length=2000, description="null: no webhook.")
