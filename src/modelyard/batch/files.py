"""Files (the OpenAI Files API): tenant-scoped records whose bytes live in the artifact store."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from modelyard.batch.validation import copy_batch_upload
from modelyard.core.errors import Invalid, NotFound, TooLarge
from modelyard.store import repository as repo
from modelyard.store import storage
from modelyard.store.artifacts import ArtifactStore
from modelyard.store.db import Database
from modelyard.store.tables import File

PURPOSES = ("batch", "batch_output", "user_data")
_FILENAME = re.compile(r"[^A-Za-z0-9._ -]")


def file_view(f: File) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": int(repo.as_utc(f.created_at).timestamp()),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
    }


def _not_found(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="file_id", code="not_found")


class FileService:
    def __init__(
        self,
        db: Database,
        store: ArtifactStore,
        max_bytes: int,
        max_line_bytes: int = 1 << 20,
        max_batch_bytes: int = 100 << 20,
        storage_bytes: int | None = None,
    ) -> None:
        self.db = db
        self.store = store
        self.max_bytes = max_bytes
        # A batch input file's bounds: each line (one request) and the whole file.
        self.max_line_bytes = max_line_bytes
        self.max_batch_bytes = max_batch_bytes
        # A tenant's storage quota unless it has its own (`store/storage.py`); None: none.
        self.storage_bytes = storage_bytes

    def spool(self, purpose: str, source: IO[bytes], out: IO[bytes]) -> None:
        """Copy an upload to `out` in chunks; a batch input file is checked on the way, each
        line and the whole (`validation.copy_batch_upload`)."""
        if purpose == "batch":
            copy_batch_upload(source, out, self.max_line_bytes, self.max_batch_bytes)
        else:
            shutil.copyfileobj(source, out, 1 << 20)

    def create_from_path(
        self, tenant_id: str, source: Path, filename: str, purpose: str
    ) -> dict[str, Any]:
        if purpose not in PURPOSES:
            raise Invalid(
                f"purpose must be one of {', '.join(PURPOSES)}",
                param="purpose",
                code="invalid_value",
            )
        size = source.stat().st_size
        if size > self.max_bytes:
            raise TooLarge(
                f"file is larger than the limit of {self.max_bytes} bytes",
                param="file",
                code="file_too_large",
            )
        if size == 0:
            raise Invalid("the file is empty", param="file", code="empty_file")
        with self.db.session() as s:  # refused before it is stored, when it cannot fit
            storage.check_room(s, tenant_id, size, self.storage_bytes)
        blob = self.store.put_file(source)
        with self.db.session() as s:
            storage.hold(s, tenant_id, blob.sha256, blob.size, self.storage_bytes)
            row = self.add_record(s, tenant_id, blob.sha256, blob.size, filename, purpose)
            return file_view(row)

    def store_bytes(self, data: bytes) -> tuple[str, int]:
        """Put bytes the platform wrote itself (batch outputs) into the store: (sha256, size)."""
        with tempfile.NamedTemporaryFile(dir=self.store.tmp) as tmp:
            tmp.write(data)
            tmp.flush()
            blob = self.store.put_file(Path(tmp.name))
        return blob.sha256, blob.size

    def add_record(
        self, s: Session, tenant_id: str, sha256: str, size: int, filename: str, purpose: str
    ) -> File:
        """The file's row, in the caller's transaction (the blob is already stored)."""
        repo.add_blob(s, tenant_id, sha256, size)
        row = File(
            id=repo.new_id("file"),
            tenant_id=tenant_id,
            filename=_FILENAME.sub("_", filename)[:200] or "file",
            purpose=purpose,
            bytes=size,
            sha256=sha256,
            created_at=repo.now(),
            deleted_at=None,
        )
        s.add(row)
        s.flush()
        return row

    def get_row(self, tenant_id: str, file_id: str) -> File:
        with self.db.session() as s:
            f = s.get(File, file_id)
            if f is None or f.tenant_id != tenant_id or f.deleted_at is not None:
                raise _not_found(file_id)
            return f

    def get(self, tenant_id: str, file_id: str) -> dict[str, Any]:
        return file_view(self.get_row(tenant_id, file_id))

    def content_path(self, tenant_id: str, file_id: str) -> Path:
        return self.store.path(self.get_row(tenant_id, file_id).sha256)

    def find_content_path(self, tenant_id: str, file_id: str) -> Path | None:
        """The file's bytes on disk, or None if the file was deleted or its bytes are gone."""
        with self.db.session() as s:
            f = s.get(File, file_id)
            if f is None or f.tenant_id != tenant_id or f.deleted_at is not None:
                return None
            path = self.store.path(f.sha256)
        return path if path.is_file() else None

    def list(
        self,
        tenant_id: str,
        purpose: str | None,
        limit: int,
        after: str | None,
        order: str = "desc",
    ) -> dict[str, Any]:
        with self.db.session() as s:
            q = select(File).where(File.tenant_id == tenant_id, File.deleted_at.is_(None))
            if purpose:
                q = q.where(File.purpose == purpose)
            if order == "asc":
                q = q.order_by(File.created_at.asc(), File.id.asc())
            else:
                q = q.order_by(File.created_at.desc(), File.id.desc())
            rows = list(s.scalars(q))
        if after:
            ids = [r.id for r in rows]
            rows = rows[ids.index(after) + 1 :] if after in ids else []
        page = rows[:limit]
        return {
            "object": "list",
            "data": [file_view(r) for r in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": len(rows) > limit,
        }

    def delete(self, tenant_id: str, file_id: str) -> dict[str, Any]:
        with self.db.session() as s:
            f = s.get(File, file_id)
            if f is None or f.tenant_id != tenant_id or f.deleted_at is not None:
                raise _not_found(file_id)
            f.deleted_at = repo.now()
            storage.release(s, tenant_id, [f.sha256])  # unless another of its files has it
        return {"id": file_id, "object": "file", "deleted": True}
