"""One batch item: sent through the gateway (retried on transient failures) and its result
and usage written once, never under a revoked key.

The runner hands in what an item needs, and nothing more: the gateway (an `ItemSender`), whose
`run_internal` sends the item holding its quota reservation, and whose `settle_item` settles
that reservation to the real count once the item's result and usage row are committed (or gives
it back when they are not). The settlement runs whatever happens to the commit; should it fail,
the reservation, never less than the real count, stays held and the failure is logged."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from typing import Any, Protocol, runtime_checkable

from sqlalchemy import update

from modelyard.batch.service import ItemStatus
from modelyard.config import PlatformSettings
from modelyard.core.errors import DomainError
from modelyard.core.identity import Principal
from modelyard.gateway.item_usage import ItemUsage
from modelyard.gateway.metering import UsageEvent
from modelyard.protocol.errors import body_of, status_of
from modelyard.store import repository as repo
from modelyard.store.db import Database, rows_changed
from modelyard.store.tables import ApiKey, Batch, BatchItem, Tenant

log = logging.getLogger(__name__)

# Failures worth another try: nothing reached a model, or the model's server broke (and none
# billed: see `ItemRunner.run`).
_TRANSIENT = {499, 500, 502, 503, 504}


def load_principal(db: Database, batch: Batch) -> Principal:
    """Who the batch's items run as: its key, with its tenant's tier and ceilings; no per-key
    rate limits (the batch budget bounds batch work instead)."""
    with db.session() as s:
        key = s.get(ApiKey, batch.key_id)
        tenant = s.get(Tenant, batch.tenant_id)
        assert tenant is not None
        return Principal.for_batch(batch.key_id, key, tenant)


@runtime_checkable
class ItemSender(Protocol):
    """Sends one item like a client's request and settles it (the gateway). Checked when the
    runner is made, so a sender missing a verb fails the start, not every item."""

    async def run_internal(
        self, principal: Principal, kind: str, payload: dict[str, Any], request_id: str
    ) -> tuple[int, dict[str, Any], ItemUsage | None]: ...

    async def settle_item(self, usage: ItemUsage, recorded: bool) -> None: ...


class ItemRunner:
    def __init__(
        self,
        settings: PlatformSettings,
        db: Database,
        sender: ItemSender,
        owner: str,
    ) -> None:
        if not isinstance(sender, ItemSender):
            raise TypeError(f"{type(sender).__name__} cannot send and settle batch items")
        self.settings = settings
        self.db = db
        self.sender = sender
        self.owner = owner  # the runner's lease owner name, kept on the items it records

    async def run(
        self,
        principal: Principal,
        kind: str,
        batch_id: str,
        item_id: int,
        custom_id: str,
        body: dict[str, Any],
        commits: set[asyncio.Task[None]],
    ) -> None:
        request_id = f"{batch_id}:{item_id}"
        delay = 1.0
        status, result = 500, {"error": {"message": "not run", "type": "server_error"}}
        usage: ItemUsage | None = None
        for attempt in range(self.settings.batch_item_attempts):
            try:
                status, result, usage = await self.sender.run_internal(
                    principal, kind, body, request_id
                )
            except DomainError as exc:  # the same mapping as the platform's routes
                status, result = status_of(exc), body_of(exc)
            except Exception as exc:  # a bug must not stop the batch: the item records it
                log.exception("batch %s item %s failed", batch_id, custom_id)
                status = 500
                result = {"error": {"message": repr(exc), "type": "server_error"}}
            # An answer with usage is final: a failure the engine worked on (a prefill cut by
            # `no_progress_timeout_s`, billed for its prompt) would only cost as much again.
            last = attempt == self.settings.batch_item_attempts - 1
            if usage is not None or status not in _TRANSIENT or last:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
        commit = asyncio.create_task(
            self._commit(principal.key_id, batch_id, item_id, request_id, status, result, usage)
        )
        commits.add(commit)
        commit.add_done_callback(commits.discard)
        await asyncio.shield(commit)

    async def _commit(
        self,
        key_id: str,
        batch_id: str,
        item_id: int,
        request_id: str,
        status: int,
        result: dict[str, Any],
        usage: ItemUsage | None,
    ) -> None:
        recorded = False
        try:
            recorded = await asyncio.to_thread(
                self._record, key_id, batch_id, item_id, request_id, status, result,
                None if usage is None else usage.event,
            )  # fmt: skip
        finally:
            if usage is not None:
                try:
                    await self.sender.settle_item(usage, recorded)
                except Exception:
                    # Its reservation (at least the real count) stays held: over, never under.
                    log.exception("batch %s: settling item %s failed", batch_id, item_id)

    def _record(
        self,
        key_id: str,
        batch_id: str,
        item_id: int,
        request_id: str,
        status: int,
        result: dict[str, Any],
        usage: UsageEvent | None,
    ) -> bool:
        """Write the item's result and its usage row in one transaction; False if the item
        had been recorded before, or the batch's key is revoked (then nothing is written)."""
        ok = status == 200
        error = None
        if not ok:
            err = result.get("error") if isinstance(result, dict) else None
            err = err if isinstance(err, dict) else {"message": str(result)}
            error = {"code": err.get("code") or err.get("type"), "message": err.get("message")}
        with self.db.session() as s:
            key = s.get(ApiKey, key_id)
            if key is None or key.revoked_at is not None:
                return False  # nothing is billed under a revoked key
            changed = rows_changed(
                s.execute(
                    update(BatchItem)
                    .where(BatchItem.id == item_id, BatchItem.status == ItemStatus.PENDING)
                    .values(
                        status=ItemStatus.DONE if ok else ItemStatus.ERROR,
                        status_code=status,
                        response=result,
                        error=error,
                        request_id=request_id,
                        finished_at=repo.now(),
                        lease_owner=self.owner,  # who recorded it (its lease no longer matters)
                        lease_expires_at=None,
                    )
                )
            )
            if changed:
                counter = Batch.completed if ok else Batch.failed
                s.execute(update(Batch).where(Batch.id == batch_id).values({counter: counter + 1}))
                if usage is not None:
                    repo.insert_usage(s, [asdict(usage)])
            return bool(changed)
