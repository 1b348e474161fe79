"""Telling a batch's owner that it ended: which URL, which secret, and delivering it once.

A batch's own `metadata.webhook_url` is called under the platform's webhook policy (checked
again at delivery) and signed with the batch's tenant's secret. `batch_webhook_url` is the
operator's: it hears only of the system tenant's batches (a platform-wide URL receiving every
tenant's batch objects would leak them to whoever runs it), signed with the system tenant's
secret. A batch is marked announced when a 2xx came back; after a restart, batches that ended in
the last day and were never announced are tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import timedelta

from sqlalchemy import select, update

from modelyard.batch.service import TERMINAL, batch_view
from modelyard.batch.webhook import Delivery, deliver, event, tenant_secret
from modelyard.batch.webhook_policy import WebhookPolicy
from modelyard.config import PlatformSettings
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import Batch, Tenant

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, settings: PlatformSettings, db: Database, policy: WebhookPolicy) -> None:
        self.settings = settings
        self.db = db
        self.policy = policy
        self._tasks: set[asyncio.Task[None]] = set()

    def _is_system(self, tenant_id: str) -> bool:
        with self.db.session() as s:
            tenant = s.get(Tenant, tenant_id)
            return bool(tenant is not None and tenant.is_system)

    async def _destination(self, batch: Batch) -> tuple[str, bool] | None:
        """The URL to call and whether it is the operator's own (trusted) one."""
        url = (batch.metadata_ or {}).get("webhook_url")
        if url:
            return str(url), False
        operator_url = self.settings.batch_webhook_url
        if not operator_url:
            return None
        if await asyncio.to_thread(self._is_system, batch.tenant_id):
            return operator_url, True
        return None

    def _delivered(self, batch_id: str) -> None:
        with self.db.session() as s:
            s.execute(
                update(Batch).where(Batch.id == batch_id).values(webhook_delivered_at=repo.now())
            )

    def notify(self, batch: Batch) -> None:
        """Announce a batch in a final state (once), in the background."""
        if batch.webhook_delivered_at is not None:
            return

        async def send() -> None:
            destination = await self._destination(batch)
            if destination is None:
                return
            url, trusted = destination
            secret = await asyncio.to_thread(tenant_secret, self.db, batch.tenant_id)
            payload = event(batch_view(batch))
            outcome = await deliver(url, self.policy, secret, payload, trusted=trusted)
            if outcome is Delivery.DELIVERED:
                await asyncio.to_thread(self._delivered, batch.id)
            else:
                log.warning("batch %s: webhook not delivered (%s)", batch.id, outcome)

        task = asyncio.create_task(send(), name=f"webhook-{batch.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def resend(self) -> None:
        """After a restart: batches that ended in the last day but were never announced."""
        since = repo.now() - timedelta(days=1)

        def load() -> list[Batch]:
            with self.db.session() as s:
                return list(
                    s.scalars(
                        select(Batch).where(
                            Batch.status.in_(TERMINAL),
                            Batch.webhook_delivered_at.is_(None),
                            Batch.created_at >= since,
                        )
                    )
                )

        for batch in await asyncio.to_thread(load):
            with contextlib.suppress(Exception):
                self.notify(batch)

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
