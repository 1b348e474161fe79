"""Why a batch must stop dispatching (cancelled, expired, its key revoked or expired), asked
before each item, and the end of a batch whose key was revoked (or expired)."""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy import select

from modelyard.batch.service import BatchStatus
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import ApiKey, Batch

_REVOKED_ERROR = {
    "code": "api_key_revoked",
    "message": "The API key that created this batch was revoked or expired: no further "
    "requests were sent; requests that had finished keep their results.",
    "param": None,
    "line": None,
}


class Stop(StrEnum):
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    REVOKED = "revoked"


def stop_reason(db: Database, batch_id: str) -> Stop | None:
    """Why dispatching must stop now, if it must: one small query, run before each item."""
    with db.session() as s:
        status, expires_at, key_id, revoked_at, key_expires_at = s.execute(
            select(Batch.status, Batch.expires_at, ApiKey.id, ApiKey.revoked_at, ApiKey.expires_at)
            .outerjoin(ApiKey, ApiKey.id == Batch.key_id)
            .where(Batch.id == batch_id)
        ).one()
    if key_id is None or revoked_at is not None:
        return Stop.REVOKED
    if key_expires_at is not None and repo.now() >= repo.as_utc(key_expires_at):
        return Stop.REVOKED  # an expired key ends its batches as a revoked one does
    if status == BatchStatus.CANCELLING:
        return Stop.CANCELLED
    if repo.now() >= repo.as_utc(expires_at):
        return Stop.EXPIRED
    return None


def end_revoked(db: Database, batch_id: str) -> Batch:
    """The key is gone: the batch ends cancelled (finished items kept), saying why."""
    with db.session() as s:
        b = s.get(Batch, batch_id)
        assert b is not None
        if b.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
            b.status = BatchStatus.CANCELLING
            b.cancelling_at = repo.now()
            b.errors = {"object": "list", "data": [_REVOKED_ERROR]}
        return b
