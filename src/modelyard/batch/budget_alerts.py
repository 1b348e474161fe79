"""A budget's soft limit crossed: one audit event and one webhook per budget and period, across
every gateway (the first to write the period's marker row sends them).

The webhook is the batch webhooks' machinery (`webhook.py`): the budget's `webhook_url`, checked
against the platform's webhook policy again at delivery, signed with the tenant's own secret
(Standard Webhooks), retried with backoff. Its body is an event like a batch's:
`{"object": "event", "type": "budget.soft_limit_crossed", "data": {...}}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from modelyard.batch.webhook import Delivery, deliver, tenant_secret
from modelyard.batch.webhook_policy import WebhookPolicy
from modelyard.core.pricing import usd
from modelyard.gateway.budgets import Budget
from modelyard.store import budgets as rows
from modelyard.store.db import Database

log = logging.getLogger(__name__)

# (actor, action, target type, target id, before, after, tenant id) -> audit event id.
AuditRecord = Callable[..., Awaitable[int]]
ALERT_ACTION = "budget.soft_limit_crossed"


def alert_data(budget: Budget, period_key: str, spent_micro: int) -> dict[str, Any]:
    return {
        "object": "budget.alert",
        "budget_id": budget.id,
        "tenant_id": budget.tenant_id,
        "scope": str(budget.scope),
        "subject_id": budget.subject_id,
        "period": str(budget.period),
        "period_key": period_key,
        "spent_usd": usd(spent_micro),
        "soft_limit_usd": usd(budget.soft_limit_micro or 0),
        "limit_usd": usd(budget.limit_micro),
    }


class BudgetAlerts:
    """The gateway's `AlertSink`: sends in the background, never on the request's path."""

    def __init__(self, db: Database, policy: WebhookPolicy, record: AuditRecord) -> None:
        self.db = db
        self.policy = policy
        self.record = record
        self._tasks: set[asyncio.Task[None]] = set()

    def crossed(self, budget: Budget, period_key: str, spent_micro: int) -> None:
        task = asyncio.create_task(self._send(budget, period_key, spent_micro), name="budget-alert")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _claim(self, budget: Budget, period_key: str, spent_micro: int) -> bool:
        with self.db.session() as s:
            return rows.claim_alert(s, budget.id, period_key, spent_micro)

    async def _send(self, budget: Budget, period_key: str, spent_micro: int) -> None:
        try:
            if not await asyncio.to_thread(self._claim, budget, period_key, spent_micro):
                return  # another gateway (or an earlier run of this one) sent it
            data = alert_data(budget, period_key, spent_micro)
            await self.record(None, ALERT_ACTION, "budget", budget.id, None, data,
                              budget.tenant_id)  # fmt: skip
            if not budget.webhook_url:
                return
            secret = await asyncio.to_thread(tenant_secret, self.db, budget.tenant_id)
            payload = {
                "id": f"evt_budget_{budget.id}_{period_key}",
                "object": "event",
                "type": ALERT_ACTION,
                "created_at": int(time.time()),
                "data": data,
            }
            outcome = await deliver(budget.webhook_url, self.policy, secret, payload)
            if outcome is not Delivery.DELIVERED:
                log.warning("budget %s: alert webhook not delivered (%s)", budget.id, outcome)
        except Exception:
            log.exception("budget %s: sending its alert failed", budget.id)

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
