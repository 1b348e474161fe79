"""Content-addressed artifact store on local disk: blobs named by their sha256.

Writes go to a temporary file that is hashed while it is written and renamed into place only
when the hash matches, so a broken or lying upload leaves nothing behind. A model version is a
manifest (relative path → sha256); a node's cache (`control.node_cache`) copies its blobs out,
verifying each hash, for workers to load. The contract every store keeps (this one and
`artifact_s3.S3ArtifactStore`) is `artifact_store.BlobStore`; the Files API's files always live
here, model blobs here or in S3.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Protocol

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 22
# Blobs are immutable and owner-only: other users of the host must not read tenants' models
# or files.
BLOB_MODE = 0o400


class ArtifactError(ValueError):
    """An upload or manifest that cannot be accepted; the message says why."""


class IntegrityError(ArtifactError):
    """A blob's content does not match its name."""


def check_sha256(value: str) -> str:
    if not _SHA256.match(value):
        raise ArtifactError(f"not a sha256 hex digest: {value!r}")
    return value


def check_relative_path(value: str) -> str:
    """Manifest paths are plain relative POSIX paths: no absolute paths, no `..`, no empties."""
    p = PurePosixPath(value)
    if not value or p.is_absolute() or any(part in ("", ".", "..") for part in p.parts):
        raise ArtifactError(f"invalid file path in manifest: {value!r}")
    if value != str(p):
        raise ArtifactError(f"file path is not normalized: {value!r}")
    return value


def hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class StoredBlob:
    sha256: str
    size: int


class ChunkReader(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class LocalArtifactStore:
    """Blobs under `root/blobs/sha256/ab/abcd…`, owner-only; uploads staged in `root/tmp`."""

    kind = "local"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs" / "sha256"
        self.tmp = root / "tmp"
        for d in (self.blobs, self.tmp):
            d.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        check_sha256(sha256)
        return self.blobs / sha256[:2] / sha256

    def has(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def size(self, sha256: str) -> int:
        return self.path(sha256).stat().st_size

    def _commit(self, tmp_path: Path, actual: str, expected: str | None) -> None:
        if expected is not None and actual != expected:
            tmp_path.unlink(missing_ok=True)
            raise IntegrityError(f"content hashes to {actual}, not {expected}")
        dest = self.path(actual)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp_path, BLOB_MODE)
        os.replace(tmp_path, dest)

    async def put_stream(
        self, chunks: AsyncIterator[bytes], expected_sha256: str | None, max_bytes: int
    ) -> StoredBlob:
        """Store a streamed upload; raises (and keeps nothing) on size or hash mismatch."""
        if expected_sha256 is not None:
            check_sha256(expected_sha256)
        digest = hashlib.sha256()
        size = 0
        fd, name = tempfile.mkstemp(dir=self.tmp, prefix="upload-")
        tmp_path = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise ArtifactError(f"upload is larger than the limit of {max_bytes} bytes")
                    digest.update(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            self._commit(tmp_path, digest.hexdigest(), expected_sha256)
        finally:
            tmp_path.unlink(missing_ok=True)  # noqa: ASYNC240 - a no-op after the rename
        return StoredBlob(digest.hexdigest(), size)

    def put_file(self, source: Path, max_bytes: int | None = None) -> StoredBlob:
        """Copy a local file into the store (hashing while copying)."""
        size = source.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise ArtifactError(f"{source} is larger than the limit of {max_bytes} bytes")
        with open(source, "rb") as src:
            return self.put_reader(src, None, max_bytes)

    def put_reader(
        self, reader: ChunkReader, expected_sha256: str | None, max_bytes: int | None = None
    ) -> StoredBlob:
        """Store what `reader` yields (hashing while copying); raises, keeping nothing, on a
        hash or size mismatch."""
        if expected_sha256 is not None:
            check_sha256(expected_sha256)
        digest = hashlib.sha256()
        size = 0
        fd, name = tempfile.mkstemp(dir=self.tmp, prefix="copy-")
        tmp_path = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                while block := reader.read(_CHUNK):
                    size += len(block)
                    if max_bytes is not None and size > max_bytes:
                        raise ArtifactError(f"blob is larger than the limit of {max_bytes} bytes")
                    digest.update(block)
                    out.write(block)
            self._commit(tmp_path, digest.hexdigest(), expected_sha256)
        finally:
            tmp_path.unlink(missing_ok=True)
        return StoredBlob(digest.hexdigest(), size)

    def open(self, sha256: str) -> BinaryIO:
        return open(self.path(sha256), "rb")

    def delete(self, sha256: str) -> None:
        self.path(sha256).unlink(missing_ok=True)

    def delete_unless_fresh(self, sha256: str, grace_s: float) -> bool:
        """Delete the blob unless it was written in the last `grace_s` seconds (an upload of
        the same content, whose hold is not recorded yet); True if it went. The bytes are moved
        aside first and their age checked again there, so an upload that landed between the
        check and the move is put back, and one that lands after it is left alone."""
        path = self.path(sha256)
        try:
            if time.time() - path.stat().st_mtime < grace_s:
                return False
            aside = self.tmp / f"reclaim-{sha256}-{uuid.uuid4().hex}"
            os.rename(path, aside)
        except FileNotFoundError:
            return False
        try:
            if time.time() - aside.stat().st_mtime < grace_s:
                with contextlib.suppress(FileExistsError):  # a newer copy is in place
                    os.link(aside, path)
                return False
            return True
        finally:
            aside.unlink(missing_ok=True)

    def list(self) -> Iterator[StoredBlob]:
        for path in sorted(self.blobs.glob("*/*")):
            if _SHA256.match(path.name) and path.is_file():
                yield StoredBlob(path.name, path.stat().st_size)

    def verify(self, sha256: str) -> None:
        actual = hash_file(self.path(sha256))
        if actual != sha256:
            raise IntegrityError(f"blob {sha256} is corrupted on disk (it hashes to {actual})")


# The name every caller used before the store had a second implementation (the Files API's
# files and the tests build it directly).
ArtifactStore = LocalArtifactStore


def make_owner_only(root: Path) -> None:
    """Strip the group and other permission bits from every file and folder under `root`."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            if mode & 0o077 and not os.path.islink(path):
                os.chmod(path, mode & 0o700)


def scan_folder(root: Path) -> Iterable[tuple[str, Path]]:
    """(relative POSIX path, file) for every regular file under `root`, or `root` itself."""
    if root.is_file():
        yield root.name, root
        return
    for path in sorted(root.rglob("*")):
        if path.is_file() and not any(p.startswith(".") for p in path.relative_to(root).parts):
            yield path.relative_to(root).as_posix(), path
