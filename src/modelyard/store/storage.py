"""A tenant's storage: the blobs it holds, its quota, and the reclamation of blobs nobody holds.

A tenant holds a blob (a `TenantBlob` row) from its upload (a registry blob, a Files API file,
a model copied from S3, a batch's output) until nothing of its own refers to it any more: no
live file and no version of its registry models. Its use is the sum of the sizes of the blobs
it holds, each counted whole whoever else holds the same content (sharing is never credited, so
nobody learns what another tenant stored). A new hold is refused past the tenant's quota
(`Tenant.max_storage_bytes`, else the platform's `tenant_storage_bytes`; the system tenant has
none) with 413 `storage_quota_exceeded`, checked under a lock of the tenant's row so that
concurrent uploads cannot all pass.

Deleting a file or a model `release`s what it held; `reclaim` (mark and sweep) then deletes the
bytes of every blob no tenant holds, in every store, unless they were written in the last
`grace_s` seconds: an upload writes its bytes before it records its hold, so a concurrent push
of the same content is never swept between the two (the store re-checks the age after moving
the bytes aside: `delete_unless_fresh`). Blob rows stay (a few bytes each; deleted files still
name theirs), so a later upload of the same content is recorded as any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sqlalchemy import exists, func, select
from sqlalchemy.orm import Session

from modelyard.core.errors import TooLarge
from modelyard.store import repository as repo
from modelyard.store.tables import Blob, File, Model, ModelVersion, Tenant, TenantBlob

if TYPE_CHECKING:
    from modelyard.store.db import Database

log = logging.getLogger(__name__)

# At most this many blobs are swept by one `reclaim` (the rest by the next).
RECLAIM_BATCH = 1000


def used_bytes(s: Session, tenant_id: str) -> int:
    """The bytes of the blobs `tenant_id` holds."""
    total = s.scalar(
        select(func.coalesce(func.sum(Blob.size), 0))
        .select_from(TenantBlob)
        .join(Blob, Blob.sha256 == TenantBlob.sha256)
        .where(TenantBlob.tenant_id == tenant_id)
    )
    return int(total or 0)


def quota_of(tenant: Tenant | None, default: int | None) -> int | None:
    """The tenant's storage quota in bytes (None: none)."""
    if tenant is None or tenant.is_system:
        return None
    return tenant.max_storage_bytes if tenant.max_storage_bytes is not None else default


def _exceeded(used: int, size: int, quota: int) -> TooLarge:
    return TooLarge(
        f"This upload of {size} bytes would take your organization's storage to {used + size} "
        f"bytes, over its quota of {quota} bytes ({used} used). Delete files or models you no "
        "longer need (their space is freed), or ask the platform administrator to raise the "
        "quota.",
        param="file",
        code="storage_quota_exceeded",
    )


def room(s: Session, tenant_id: str, default: int | None) -> int | None:
    """The bytes the tenant may still store (None: no quota)."""
    quota = quota_of(s.get(Tenant, tenant_id), default)
    return None if quota is None else max(0, quota - used_bytes(s, tenant_id))


def check_room(s: Session, tenant_id: str, size: int, default: int | None) -> None:
    """Refuse (before any byte is stored) an upload of `size` that would not fit."""
    quota = quota_of(s.get(Tenant, tenant_id), default)
    if quota is not None:
        used = used_bytes(s, tenant_id)
        if used + size > quota:
            raise _exceeded(used, size, quota)


def hold(s: Session, tenant_id: str, sha256: str, size: int, default: int | None) -> None:
    """Record that `tenant_id` holds the blob, within its quota (`default` when it has none of
    its own). What the platform writes for a tenant (batch outputs) is recorded through
    `repo.add_blob`: counted, never refused."""
    if repo.owns_blob(s, tenant_id, sha256):
        return
    tenant = s.get(Tenant, tenant_id, with_for_update=True)  # one hold at a time per tenant
    if repo.owns_blob(s, tenant_id, sha256):  # a concurrent upload of the same content won
        return
    quota = quota_of(tenant, default)
    if quota is not None:
        used = used_bytes(s, tenant_id)
        if used + size > quota:
            raise _exceeded(used, size, quota)
    repo.add_blob(s, tenant_id, sha256, size)


def _referenced(s: Session, tenant_id: str, shas: set[str]) -> set[str]:
    """Which of `shas` a live file or a registry version of the tenant still refers to."""
    live = set(
        s.scalars(
            select(File.sha256).where(
                File.tenant_id == tenant_id, File.deleted_at.is_(None), File.sha256.in_(shas)
            )
        )
    )
    manifests = s.scalars(
        select(ModelVersion.manifest)
        .join(Model, Model.id == ModelVersion.model_id)
        .where(Model.tenant_id == tenant_id)
    )
    for manifest in manifests:
        live.update(_shas_of(manifest) & shas)
    return live


def _shas_of(manifest: dict[str, Any]) -> set[str]:
    files = manifest.get("files") or {}
    return {str(entry.get("sha256")) for entry in files.values() if isinstance(entry, dict)}


def shas_of_versions(versions: Iterable[ModelVersion]) -> set[str]:
    out: set[str] = set()
    for v in versions:
        out |= _shas_of(v.manifest)
    return out


def release(s: Session, tenant_id: str, shas: Iterable[str]) -> None:
    """The tenant stops holding those of `shas` nothing of its own refers to any more (call
    after the file or model is gone, in the same transaction)."""
    wanted = set(shas)
    if not wanted:
        return
    s.flush()
    for sha in wanted - _referenced(s, tenant_id, wanted):
        row = s.get(TenantBlob, (tenant_id, sha))
        if row is not None:
            s.delete(row)


def reclaim(db: Database, stores: Iterable[Any], grace_s: float) -> int:
    """Delete from every store the bytes of the blobs no tenant holds, except those written in
    the last `grace_s` seconds; returns how many blobs went."""
    with db.session() as s:
        unheld = list(
            s.scalars(
                select(Blob.sha256)
                .where(~exists().where(TenantBlob.sha256 == Blob.sha256))
                .limit(RECLAIM_BATCH)
            )
        )
    distinct = {id(store): store for store in stores}.values()
    gone = 0
    for sha in unheld:
        deleted = False
        for store in distinct:
            try:
                deleted |= store.delete_unless_fresh(sha, grace_s)
            except Exception as exc:  # one store's failure must not stop the sweep
                log.warning("reclaiming blob %s failed: %s", sha, exc)
        gone += deleted
    if gone:
        log.info("reclaimed %d blobs no tenant holds", gone)
    return gone


class Reclaimer:
    """`reclaim` off the event loop: every `interval_s`, and soon after a delete (`soon`)."""

    def __init__(self, db: Database, stores: list[Any], grace_s: float, interval_s: float) -> None:
        self.db, self.stores = db, stores
        self.grace_s, self.interval_s = grace_s, interval_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="blob-reclaimer")

    def soon(self) -> None:
        """A file or model was deleted: sweep now rather than at the next interval."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            try:
                await asyncio.to_thread(reclaim, self.db, self.stores, self.grace_s)
            except Exception:
                log.exception("reclaiming unheld blobs failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
