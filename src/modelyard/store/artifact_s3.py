"""Content-addressed blobs in an S3 bucket (AWS, MinIO or any S3-compatible store), shared by
every node of a cluster.

A blob lives at `<prefix>blobs/sha256/ab/abcd…`. An upload is a multipart upload to that key,
hashed while its parts go up, and completed only when the sha256 matches the name; a mismatch
(or a size over the limit, or any failure) aborts it, so S3 never shows an object under a name
its content does not have. When the name is not known in advance (a file hashed as it is read)
the parts go to a temporary key first, and the object is copied to its name once the hash is
known. Readers verify again: a blob that was changed in the bucket afterwards is refused by the
node cache. Credentials come from the standard AWS chain (environment, shared config, instance
role); the endpoint URL and region from the settings.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelyard.store.artifacts import (
    ArtifactError,
    ChunkReader,
    IntegrityError,
    StoredBlob,
    check_sha256,
    hash_file,
)

if TYPE_CHECKING:
    from modelyard.config import PlatformSettings

# S3's smallest part (but the last) is 5 MiB; 8 MiB parts keep a 64 GiB blob under the
# 10,000-part limit.
PART_BYTES = 8 << 20
_READ = 1 << 20


def make_s3_client(endpoint_url: str | None, region: str | None) -> Any:
    """A boto3 S3 client; path-style addressing when an endpoint URL is set (MinIO, moto)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - boto3 is a dependency
        raise ArtifactError("the s3 artifact store needs boto3 (pip install boto3)") from exc
    config = Config(
        retries={"max_attempts": 4, "mode": "standard"},
        s3={"addressing_style": "path"} if endpoint_url else None,
        connect_timeout=5,
        read_timeout=60,
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint_url, region_name=region, config=config
    )


def _missing(exc: Exception) -> bool:
    code = getattr(exc, "response", {}).get("Error", {}).get("Code")
    return code in ("404", "NoSuchKey", "NotFound")


class _Upload:
    """One object written in parts; nothing is visible until `finish` completes it."""

    def __init__(self, client: Any, bucket: str, key: str) -> None:
        self.client = client
        self.bucket = bucket
        self.key = key
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []

    def add(self, chunk: bytes) -> None:
        self.buffer += chunk
        if len(self.buffer) >= PART_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self.upload_id is None:
            created = self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)
            self.upload_id = created["UploadId"]
        number = len(self.parts) + 1
        part = self.client.upload_part(
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=bytes(self.buffer),
        )
        self.parts.append({"ETag": part["ETag"], "PartNumber": number})
        self.buffer.clear()

    def finish(self) -> None:
        if self.upload_id is None:  # a blob smaller than a part: one request
            self.client.put_object(Bucket=self.bucket, Key=self.key, Body=bytes(self.buffer))
            return
        if self.buffer:
            self._flush()
        self.client.complete_multipart_upload(
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": self.parts},
        )

    def abort(self) -> None:
        self.buffer.clear()
        if self.upload_id is not None:
            with suppress(
                Exception
            ):  # an orphaned upload only costs storage until a lifecycle rule
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=self.key, UploadId=self.upload_id
                )


class S3ArtifactStore:
    kind = "s3"

    def __init__(self, client: Any, bucket: str, prefix: str = "") -> None:
        if not bucket:
            raise ArtifactError("the s3 artifact store needs a bucket (MODELYARD_S3_BUCKET)")
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

    @classmethod
    def from_settings(cls, settings: PlatformSettings) -> S3ArtifactStore:
        client = make_s3_client(settings.s3_endpoint_url, settings.s3_region)
        return cls(client, settings.s3_bucket or "", settings.s3_prefix)

    def __repr__(self) -> str:
        return f"S3ArtifactStore(s3://{self.bucket}/{self.prefix})"

    def key(self, sha256: str) -> str:
        check_sha256(sha256)
        return f"{self.prefix}blobs/sha256/{sha256[:2]}/{sha256}"

    # ----- reads ------------------------------------------------------------------------------

    def _head(self, sha256: str) -> dict[str, Any] | None:
        try:
            return dict(self.client.head_object(Bucket=self.bucket, Key=self.key(sha256)))
        except Exception as exc:
            if _missing(exc):
                return None
            raise

    def has(self, sha256: str) -> bool:
        return self._head(sha256) is not None

    def size(self, sha256: str) -> int:
        head = self._head(sha256)
        if head is None:
            raise FileNotFoundError(f"blob {sha256} is not in s3://{self.bucket}/{self.prefix}")
        return int(head["ContentLength"])

    def open(self, sha256: str) -> Any:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key(sha256))["Body"]
        except Exception as exc:
            if _missing(exc):
                raise FileNotFoundError(
                    f"blob {sha256} is not in s3://{self.bucket}/{self.prefix}"
                ) from exc
            raise

    def list(self) -> Iterator[StoredBlob]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}blobs/sha256/"
        )
        for page in pages:
            for obj in page.get("Contents", []):
                name = obj["Key"].rsplit("/", 1)[-1]
                with suppress(ArtifactError):
                    yield StoredBlob(check_sha256(name), int(obj["Size"]))

    def verify(self, sha256: str) -> None:
        digest = hashlib.sha256()
        body = self.open(sha256)
        try:
            while block := body.read(_READ):
                digest.update(block)
        finally:
            body.close()
        if digest.hexdigest() != sha256:
            raise IntegrityError(
                f"blob {sha256} is corrupted in the bucket (it hashes to {digest.hexdigest()})"
            )

    # ----- writes -----------------------------------------------------------------------------

    def delete(self, sha256: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key(sha256))

    def delete_unless_fresh(self, sha256: str, grace_s: float) -> bool:
        """Delete the blob unless it was written in the last `grace_s` seconds; True if it
        went. (S3 has no move-aside: a push of the same content landing between the check
        and the delete, a window of one round trip, finds its blob missing when it registers
        the version, and uploads it again.)"""
        head = self._head(sha256)
        if head is None:
            return False
        modified = head.get("LastModified")
        if modified is not None and (datetime.now(UTC) - modified).total_seconds() < grace_s:
            return False
        self.delete(sha256)
        return True

    def _start(self, expected_sha256: str | None) -> _Upload:
        if expected_sha256 is not None:
            return _Upload(self.client, self.bucket, self.key(check_sha256(expected_sha256)))
        return _Upload(self.client, self.bucket, f"{self.prefix}tmp/upload-{uuid.uuid4().hex}")

    def _finish(self, upload: _Upload, actual: str, expected: str | None) -> None:
        """Complete the upload only if the content is what its name says."""
        if expected is not None and actual != expected:
            upload.abort()
            raise IntegrityError(f"content hashes to {actual}, not {expected}")
        upload.finish()
        if expected is None:  # staged under a temporary key: now it gets its name
            try:
                self.client.copy(
                    {"Bucket": self.bucket, "Key": upload.key}, self.bucket, self.key(actual)
                )
            finally:
                with suppress(Exception):
                    self.client.delete_object(Bucket=self.bucket, Key=upload.key)

    async def put_stream(
        self, chunks: AsyncIterator[bytes], expected_sha256: str | None, max_bytes: int
    ) -> StoredBlob:
        """A streamed upload, its parts sent from a thread as they fill. A blob the bucket
        already has is only hashed (the caller still proves it has the content)."""
        exists = expected_sha256 is not None and await asyncio.to_thread(self.has, expected_sha256)
        upload = None if exists else self._start(expected_sha256)
        digest = hashlib.sha256()
        size = 0
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise ArtifactError(f"upload is larger than the limit of {max_bytes} bytes")
                digest.update(chunk)
                if upload is not None:
                    if len(upload.buffer) + len(chunk) >= PART_BYTES:
                        await asyncio.to_thread(upload.add, chunk)
                    else:
                        upload.buffer += chunk
            actual = digest.hexdigest()
            if upload is None:
                if actual != expected_sha256:
                    raise IntegrityError(f"content hashes to {actual}, not {expected_sha256}")
            else:
                await asyncio.to_thread(self._finish, upload, actual, expected_sha256)
        except BaseException:
            if upload is not None:
                await asyncio.to_thread(upload.abort)
            raise
        return StoredBlob(actual, size)

    def put_reader(
        self, reader: ChunkReader, expected_sha256: str | None, max_bytes: int | None = None
    ) -> StoredBlob:
        upload = self._start(expected_sha256)
        digest = hashlib.sha256()
        size = 0
        try:
            while block := reader.read(_READ):
                size += len(block)
                if max_bytes is not None and size > max_bytes:
                    raise ArtifactError(f"blob is larger than the limit of {max_bytes} bytes")
                digest.update(block)
                upload.add(block)
            self._finish(upload, digest.hexdigest(), expected_sha256)
        except BaseException:
            upload.abort()
            raise
        return StoredBlob(digest.hexdigest(), size)

    def put_file(self, source: Path, max_bytes: int | None = None) -> StoredBlob:
        """Hashed first, so the upload goes straight to its name (and is checked again while it
        goes up: a file changed in between is refused); a blob already there is not sent."""
        size = source.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise ArtifactError(f"{source} is larger than the limit of {max_bytes} bytes")
        sha256 = hash_file(source)
        if self.has(sha256):
            return StoredBlob(sha256, size)
        with open(source, "rb") as src:
            return self.put_reader(src, sha256, max_bytes)
