"""The artifact store's contract, and the one place that picks its implementation.

A model's files are content-addressed blobs named by their sha256. Every implementation writes a
blob only when its content hashes to its name (nothing half-written or corrupted ever becomes
visible under a name), and its readers verify again (`control.node_cache`). Two exist:
`LocalArtifactStore` (files under the data dir: the embedded mode) and `S3ArtifactStore` (one
bucket and prefix shared by every node of a cluster; MinIO and other S3-compatible stores through
`s3_endpoint_url`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from modelyard.store.artifacts import LocalArtifactStore, StoredBlob

if TYPE_CHECKING:
    from modelyard.config import PlatformSettings


class BlobReader(Protocol):
    """A blob's bytes, read in chunks (a local file, or an S3 object's body)."""

    def read(self, size: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


class BlobStore(Protocol):
    """Content-addressed blobs; every write is verified against the hash before it is visible."""

    kind: str

    async def put_stream(
        self, chunks: AsyncIterator[bytes], expected_sha256: str | None, max_bytes: int
    ) -> StoredBlob:
        """Store a streamed upload; raises `IntegrityError` (keeping nothing) when it does not
        hash to `expected_sha256`, `ArtifactError` when it exceeds `max_bytes`."""
        ...

    def put_reader(
        self, reader: BlobReader, expected_sha256: str | None, max_bytes: int | None = None
    ) -> StoredBlob:
        """The same from a synchronous reader (an object in another bucket, a local file)."""
        ...

    def put_file(self, source: Path, max_bytes: int | None = None) -> StoredBlob: ...

    def open(self, sha256: str) -> BlobReader:
        """The blob's bytes as stored (the caller verifies them while reading)."""
        ...

    def has(self, sha256: str) -> bool: ...

    def size(self, sha256: str) -> int: ...

    def delete(self, sha256: str) -> None: ...

    def delete_unless_fresh(self, sha256: str, grace_s: float) -> bool:
        """Delete the blob unless written in the last `grace_s` seconds; True if it went."""
        ...

    def list(self) -> Iterator[StoredBlob]: ...

    def verify(self, sha256: str) -> None:
        """Raise `IntegrityError` if the stored bytes no longer hash to the name."""
        ...


def open_artifact_store(settings: PlatformSettings, local: LocalArtifactStore) -> BlobStore:
    """The store model blobs go to: `local` (the data dir's) unless `artifact_store` is `s3`."""
    if settings.artifact_store == "s3":
        from modelyard.store.artifact_s3 import S3ArtifactStore

        return S3ArtifactStore.from_settings(settings)
    return local
