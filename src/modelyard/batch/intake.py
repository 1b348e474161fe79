"""A batch's intake: its input file read and validated into item rows, once, by one runner."""

from __future__ import annotations

from typing import Any

from modelyard.batch.files import FileService
from modelyard.batch.service import BatchStatus, ItemStatus
from modelyard.batch.validation import BatchFileInvalid, validate_file
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import Batch, BatchItem


def _fail(db: Database, batch_id: str, errors: list[dict[str, Any]]) -> Batch:
    with db.session() as s:
        b = s.get(Batch, batch_id)
        assert b is not None
        b.status = BatchStatus.FAILED
        b.failed_at = repo.now()
        b.errors = {"object": "list", "data": errors}
        return b


def validate_batch(db: Database, files: FileService, batch: Batch) -> Batch:
    """Read the input file into item rows (bad lines finished at once, as errors) and start the
    batch; fail it when the file is gone or has no good line."""
    path = files.find_content_path(batch.tenant_id, batch.input_file_id)
    try:
        if path is None:
            raise FileNotFoundError(batch.input_file_id)
        good, bad = validate_file(path, batch.endpoint, files.max_line_bytes, files.max_batch_bytes)
    except FileNotFoundError:
        missing = {
            "code": "input_file_missing",
            "message": f"The input file {batch.input_file_id} was deleted before the "
            "batch could read it.",
            "param": "input_file_id",
            "line": None,
        }
        return _fail(db, batch.id, [missing])
    except BatchFileInvalid as exc:
        return _fail(db, batch.id, exc.errors)
    with db.session() as s:
        # Locked: of several runners validating at once, one writes the items.
        b = s.get(Batch, batch.id, with_for_update=True)
        assert b is not None
        if b.status != BatchStatus.VALIDATING:  # cancelled, or validated by another runner
            return b
        s.add_all(
            BatchItem(batch_id=b.id, line=g.line, custom_id=g.custom_id, body=g.body,
                      status=ItemStatus.PENDING)
            for g in good
        )  # fmt: skip
        # A bad line is finished at once: it goes to the error file, the rest goes on.
        s.add_all(
            BatchItem(
                batch_id=b.id, line=x.line, custom_id=x.custom_id or f"line-{x.line}",
                valid=False, body=None, status=ItemStatus.ERROR, status_code=400,
                response=None, error={"code": x.code, "message": x.message, "line": x.line},
                finished_at=repo.now(),
            )
            for x in bad
        )  # fmt: skip
        b.total = len(good) + len(bad)
        b.failed = len(bad)
        b.status = BatchStatus.IN_PROGRESS
        b.in_progress_at = repo.now()
        return b
