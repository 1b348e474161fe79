"""A batch's end: its output and error files written, and its final state set, in one commit.

Also the bulk endings of items that will not run: those left when the window expires.
"""

from __future__ import annotations

import orjson
from sqlalchemy import select, update

from modelyard.batch.files import FileService
from modelyard.batch.service import BatchStatus, ItemStatus
from modelyard.store import repository as repo
from modelyard.store.db import Database, rows_changed
from modelyard.store.tables import Batch, BatchItem

# Line separators that JSON leaves unescaped but Python's `str.splitlines()` (and some other
# readers) split on: escaped, every line of an output file stays one line for any reader.
_SEPARATORS = (
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
    (b"\xc2\x85", b"\\u0085"),
)


def _line(item: BatchItem) -> bytes:
    response = None
    if item.response is not None and item.status_code is not None:
        response = {
            "status_code": item.status_code,
            "request_id": item.request_id,
            "body": item.response,
        }
    line = orjson.dumps(
        {
            "id": f"batch_req_{item.id}",
            "custom_id": item.custom_id,
            "response": response,
            "error": item.error,
        }
    )
    for raw, escaped in _SEPARATORS:
        line = line.replace(raw, escaped)
    return line


def finalize(db: Database, files: FileService, batch_id: str) -> bool:
    """Write the batch's files and end it; False if another runner ended it first (the row is
    locked, so of several runners finalizing at once one writes the files)."""
    with db.session() as s:
        b = s.get(Batch, batch_id, with_for_update=True)
        assert b is not None
        if b.status not in (BatchStatus.FINALIZING, BatchStatus.CANCELLING):
            return False
        items = list(
            s.scalars(
                select(BatchItem)
                .where(BatchItem.batch_id == batch_id, BatchItem.status != ItemStatus.PENDING)
                .order_by(BatchItem.line)
            )
        )
        done = b"\n".join(_line(i) for i in items if i.status == ItemStatus.DONE)
        failed = b"\n".join(_line(i) for i in items if i.status == ItemStatus.ERROR)
        # The files and the batch's new state commit together: no half-finalized batch.
        output = errors = None
        if done:
            sha, size = files.store_bytes(done + b"\n")
            output = files.add_record(
                s, b.tenant_id, sha, size, f"{b.id}_output.jsonl", "batch_output"
            )
        if failed:
            sha, size = files.store_bytes(failed + b"\n")
            errors = files.add_record(
                s, b.tenant_id, sha, size, f"{b.id}_error.jsonl", "batch_output"
            )
        b.output_file_id = output.id if output else None
        b.error_file_id = errors.id if errors else None
        now = repo.now()
        if b.status == BatchStatus.CANCELLING:
            b.status, b.cancelled_at = BatchStatus.CANCELLED, now
        elif b.expired_at is not None:
            b.status = BatchStatus.EXPIRED
        else:
            b.status, b.completed_at = BatchStatus.COMPLETED, now
        return True


def expire_pending(db: Database, batch_id: str) -> None:
    with db.session() as s:
        n = rows_changed(s.execute(
            update(BatchItem)
            .where(BatchItem.batch_id == batch_id, BatchItem.status == ItemStatus.PENDING)
            .values(
                status=ItemStatus.ERROR,
                error={"code": "batch_expired",
                       "message": "This request could not be executed before the "
                                  "completion window expired."},
                finished_at=repo.now(),
            )
        ))  # fmt: skip
        s.execute(update(Batch).where(Batch.id == batch_id).values(failed=Batch.failed + n))
