"""Batch items claimed with leases, so that several runners (one per controller) work on the
same batches without sending an item twice while its runner lives, and take over the items of a
runner that died.

A runner claims a pending item by writing its `lease_owner` and `lease_expires_at` in one
statement: on PostgreSQL an `UPDATE … WHERE id IN (SELECT … FOR UPDATE SKIP LOCKED)`, so
concurrent runners never wait for or claim the same row; on SQLite the same single statement
(SQLite runs one writer at a time, so it is atomic as it is). Only items whose lease is absent
or expired are claimable. While an item runs its lease is renewed; a runner that dies stops
renewing, and once the lease expires another runner claims the item. The lease decides who
*sends* an item; who *records* it is decided by the item's status (`items.ItemRunner._record`
writes a result only while the item is pending), so a result is committed exactly once even when
a stalled runner and its successor both ran the item.

On PostgreSQL lease times are the database's clock (`now()`), so runners on different machines
need no synchronised clocks; on SQLite (one machine) the process's clock.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Collection
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import aliased

from modelyard.batch.service import ItemStatus
from modelyard.store import repository as repo
from modelyard.store.db import Database, rows_changed
from modelyard.store.tables import BatchItem


def runner_identity(data_dir: Path) -> str:
    """A runner's lease owner name: the same for every start of one install on one host, so a
    restarted runner can take back at once what its killed predecessor held."""
    digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:10]
    return f"{socket.gethostname()[:80]}:{digest}"


@dataclass(frozen=True)
class ClaimedItem:
    id: int
    custom_id: str
    body: dict[str, Any]


class ItemLeases:
    def __init__(self, db: Database, owner: str, lease_s: float) -> None:
        self.db = db
        self.owner = owner
        self.lease_s = lease_s

    def _now(self) -> Any:
        return func.now() if self.db.dialect == "postgresql" else repo.now()

    def _until(self) -> Any:
        return self._now() + timedelta(seconds=self.lease_s)

    def claim(self, batch_id: str, exclude: Collection[int] = ()) -> ClaimedItem | None:
        """The batch's next pending item nobody holds, now leased to this runner; None if there
        is none (all done, or all held by live runners). `exclude`: items this runner is still
        running (an expired lease of its own must not be claimed twice)."""
        # Its own alias: the subquery must not be correlated with the updated table (that
        # would make it true for every row of the batch). `id = (…)`, not `id IN (…)`:
        # PostgreSQL runs a scalar subquery once, but may rescan an IN subquery for every row
        # of a semi-join, and each rescan locks and hands out another row.
        item = aliased(BatchItem)
        pick = (
            select(item.id)
            .where(
                item.batch_id == batch_id,
                item.status == ItemStatus.PENDING,
                or_(item.lease_expires_at.is_(None), item.lease_expires_at < self._now()),
            )
            .order_by(item.line)
            .limit(1)
        )
        if exclude:
            pick = pick.where(item.id.not_in(list(exclude)))
        if self.db.dialect == "postgresql":
            pick = pick.with_for_update(skip_locked=True)
        stmt = (
            update(BatchItem)
            .where(BatchItem.id == pick.scalar_subquery())
            .where(BatchItem.status == ItemStatus.PENDING)
            .values(lease_owner=self.owner, lease_expires_at=self._until())
            .returning(BatchItem.id, BatchItem.custom_id, BatchItem.body)
            .execution_options(synchronize_session=False)
        )
        with self.db.session() as s:
            row = s.execute(stmt).first()
        return None if row is None else ClaimedItem(row[0], row[1], row[2] or {})

    def renew(self, item_ids: Collection[int]) -> set[int]:
        """Extend the leases this runner still holds; returns those ids (an item missing was
        finished, or taken over after this runner's lease expired)."""
        if not item_ids:
            return set()
        stmt = (
            update(BatchItem)
            .where(
                BatchItem.id.in_(list(item_ids)),
                BatchItem.lease_owner == self.owner,
                BatchItem.status == ItemStatus.PENDING,
            )
            .values(lease_expires_at=self._until())
            .returning(BatchItem.id)
            .execution_options(synchronize_session=False)
        )
        with self.db.session() as s:
            return set(s.scalars(stmt))

    def release(self, item_ids: Collection[int] | None = None) -> int:
        """Give back leases of items this runner will not run now (None: all it holds, as a
        restarted runner does for its predecessor's); another runner may claim them at once."""
        stmt = update(BatchItem).where(
            BatchItem.lease_owner == self.owner, BatchItem.status == ItemStatus.PENDING
        )
        if item_ids is not None:
            if not item_ids:
                return 0
            stmt = stmt.where(BatchItem.id.in_(list(item_ids)))
        stmt = stmt.values(lease_owner=None, lease_expires_at=None).execution_options(
            synchronize_session=False
        )
        with self.db.session() as s:
            return rows_changed(s.execute(stmt))

    def pending(self, batch_id: str) -> int:
        """Items of the batch not finished yet, held by a runner or not."""
        with self.db.session() as s:
            return int(
                s.scalar(
                    select(func.count())
                    .select_from(BatchItem)
                    .where(BatchItem.batch_id == batch_id, BatchItem.status == ItemStatus.PENDING)
                )
                or 0
            )
