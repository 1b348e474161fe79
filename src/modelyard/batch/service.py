"""Batches (the OpenAI Batches API): creating, reading, listing and cancelling them.

The state machine: validating → in_progress → finalizing → completed, with failed (the input
file is unusable), cancelling → cancelled, and expired (the completion window passed). The
runner moves batches along; this module answers the API and renders the OpenAI batch object.
"""

from __future__ import annotations

import re
from datetime import timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import select

from modelyard.batch.files import FileService
from modelyard.batch.validation import ENDPOINTS
from modelyard.batch.webhook_policy import WebhookPolicy, WebhookRefused
from modelyard.core.errors import Conflict, Invalid, NotFound
from modelyard.core.identity import Principal
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import Batch


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class ItemStatus(StrEnum):
    PENDING = "pending"
    DONE = "done"
    ERROR = "error"


ACTIVE = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.CANCELLING,
)
TERMINAL = (
    BatchStatus.COMPLETED,
    BatchStatus.FAILED,
    BatchStatus.EXPIRED,
    BatchStatus.CANCELLED,
)
_WINDOW = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_window(window: str) -> timedelta:
    """OpenAI accepts "24h"; any N followed by s, m, h or d up to 7 days is accepted here."""
    match = _WINDOW.match(window)
    seconds = int(match.group(1)) * _UNITS[match.group(2)] if match else 0
    if not 1 <= seconds <= 7 * 86400:
        raise Invalid(
            "completion_window must look like 24h (between 1s and 7d)",
            param="completion_window",
            code="invalid_value",
        )
    return timedelta(seconds=seconds)


def _ts(value: Any) -> int | None:
    return None if value is None else int(repo.as_utc(value).timestamp())


def batch_view(b: Batch) -> dict[str, Any]:
    return {
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": b.errors,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": b.status,
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": _ts(b.created_at),
        "in_progress_at": _ts(b.in_progress_at),
        "expires_at": _ts(b.expires_at),
        "finalizing_at": _ts(b.finalizing_at),
        "completed_at": _ts(b.completed_at),
        "failed_at": _ts(b.failed_at),
        "expired_at": _ts(b.expired_at),
        "cancelling_at": _ts(b.cancelling_at),
        "cancelled_at": _ts(b.cancelled_at),
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": b.metadata_,
    }


def _not_found(batch_id: str) -> NotFound:
    return NotFound(f"No such batch: {batch_id}", param="batch_id", code="not_found")


class BatchService:
    def __init__(self, db: Database, files: FileService, webhooks: WebhookPolicy) -> None:
        self.db = db
        self.files = files
        self.webhooks = webhooks

    def _check_webhook(self, metadata: dict[str, str] | None) -> None:
        url = (metadata or {}).get("webhook_url")
        if url is None:
            return
        try:
            self.webhooks.check(url)
        except WebhookRefused as exc:
            raise Invalid(
                f"metadata.webhook_url is refused: {exc}",
                param="metadata.webhook_url",
                code="invalid_webhook_url",
            ) from exc

    def create(
        self,
        principal: Principal,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
    ) -> dict[str, Any]:
        if endpoint not in ENDPOINTS:
            raise Invalid(
                f"endpoint must be one of {', '.join(ENDPOINTS)}",
                param="endpoint",
                code="invalid_value",
            )
        window = parse_window(completion_window)
        self._check_webhook(metadata)
        source = self.files.get_row(principal.tenant_id, input_file_id)
        if source.purpose != "batch":
            raise Invalid(
                f"file {input_file_id} has purpose {source.purpose!r}, not 'batch'",
                param="input_file_id",
                code="invalid_value",
            )
        now = repo.now()
        row = Batch(
            id=repo.new_id("batch"),
            tenant_id=principal.tenant_id,
            key_id=principal.key_id,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status=BatchStatus.VALIDATING,
            errors=None,
            output_file_id=None,
            error_file_id=None,
            metadata_=metadata,
            total=0,
            completed=0,
            failed=0,
            created_at=now,
            expires_at=now + window,
            in_progress_at=None,
            finalizing_at=None,
            completed_at=None,
            failed_at=None,
            expired_at=None,
            cancelling_at=None,
            cancelled_at=None,
            webhook_delivered_at=None,
        )
        with self.db.session() as s:
            s.add(row)
        return batch_view(row)

    def get(self, tenant_id: str, batch_id: str) -> dict[str, Any]:
        with self.db.session() as s:
            b = s.get(Batch, batch_id)
            if b is None or b.tenant_id != tenant_id:
                raise _not_found(batch_id)
            return batch_view(b)

    def list(self, tenant_id: str, limit: int, after: str | None) -> dict[str, Any]:
        with self.db.session() as s:
            q = select(Batch).where(Batch.tenant_id == tenant_id)
            if after:
                anchor = s.get(Batch, after)
                if anchor is None or anchor.tenant_id != tenant_id:
                    raise _not_found(after)
                q = q.where(
                    (Batch.created_at < anchor.created_at)
                    | ((Batch.created_at == anchor.created_at) & (Batch.id < anchor.id))
                )
            rows = list(
                s.scalars(q.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1))
            )
        page = rows[:limit]
        return {
            "object": "list",
            "data": [batch_view(b) for b in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": len(rows) > limit,
        }

    def cancel(self, tenant_id: str, batch_id: str) -> dict[str, Any]:
        with self.db.session() as s:
            b = s.get(Batch, batch_id)
            if b is None or b.tenant_id != tenant_id:
                raise _not_found(batch_id)
            if b.status in TERMINAL:
                raise Conflict(
                    f"batch {batch_id} is already {b.status}", code="batch_not_cancellable"
                )
            if b.status != BatchStatus.CANCELLING:
                b.status = BatchStatus.CANCELLING
                b.cancelling_at = repo.now()
            return batch_view(b)
