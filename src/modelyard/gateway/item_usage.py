"""What a served batch item still holds once its worker answered, until the runner commits its
result: its monthly quota tokens and its budgets' spend (`Accounting.settle_item`)."""

from __future__ import annotations

from dataclasses import dataclass

from modelyard.core.identity import Limits
from modelyard.gateway.budgets import BudgetHold
from modelyard.gateway.call import Call
from modelyard.gateway.metering import UsageEvent


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
    budget: BudgetHold | None = None  # spend held on its budgets


def item_usage(call: Call, event: UsageEvent) -> ItemUsage:
    p = call.principal
    held = None
    if call.quota_reserved:
        held = QuotaHold(p.tenant_id, p.key_id, p.limits, call.quota_month, call.quota_reserved)
    return ItemUsage(event, held, call.budget)
