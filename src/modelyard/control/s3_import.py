"""Deploy by `s3://bucket/key` reference: a model folder (or one GGUF file) under an S3 prefix
imported into the registry, so that it is served like any pushed version.

Only buckets listed in `s3_import_buckets` may be named (the platform's own credentials read
them, so the list is the operator's decision of what any tenant admin may deploy); anything else
is a 400 naming the bucket. Each object is copied into the artifact store hashed while it
streams, and stored under the hash it has; an object carrying a `sha256` in its metadata must
match it. The registry model is named after the location (`s3.<bucket>.<key path>`), and a new
version is made only when the files differ from its newest one, so deploying the same prefix
again reuses the version.
"""

from __future__ import annotations

import hashlib
import logging
import re
from contextlib import closing
from typing import Any

from modelyard.config import PlatformSettings
from modelyard.control.registry import Registry, ResolvedVersion
from modelyard.core.errors import DomainError, Invalid, Unavailable
from modelyard.core.identity import Principal
from modelyard.store.artifact_s3 import make_s3_client
from modelyard.store.artifacts import ArtifactError, check_relative_path, check_sha256

log = logging.getLogger(__name__)

_PARAM = "model_artifact"
# An S3 bucket name (the DNS-compatible rules): lowercase letters, digits, '.', '-'.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_MAX_FILES = 10_000
_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix/` → ("bucket", "some/prefix/")."""
    rest = url.removeprefix("s3://")
    bucket, _, key = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise Invalid(f"{url!r} does not name an S3 bucket", param=_PARAM, code="invalid_value")
    if not key.strip("/"):
        raise Invalid(
            f"{url!r} names a bucket but no model in it: use s3://{bucket}/path/to/model/",
            param=_PARAM,
            code="invalid_value",
        )
    return bucket, key


def registry_name(bucket: str, key: str) -> str:
    """The registry model that tracks an S3 location (names allow letters, digits, . _ -)."""
    path = _NAME_CHARS.sub("-", key.strip("/").replace("/", "."))
    name = f"s3.{bucket}.{path}".strip(".-")
    if len(name) > 128:
        digest = hashlib.sha256(f"{bucket}/{key}".encode()).hexdigest()[:12]
        name = f"{name[:115]}.{digest}"
    return name


def _objects(client: Any, bucket: str, key: str) -> dict[str, dict[str, Any]]:
    """Relative path → the listed object, for the model at `key`: one object named exactly so
    (a single file), else every object under `key/` (hidden files and folder markers left out)."""
    folder = key if key.endswith("/") else key + "/"
    found: dict[str, dict[str, Any]] = {}
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key.rstrip("/"))
    for page in pages:
        for obj in page.get("Contents", []):
            name: str = obj["Key"]
            if name == key and not key.endswith("/"):
                return {name.rsplit("/", 1)[-1]: obj}
            if not name.startswith(folder) or name.endswith("/"):
                continue
            rel = name[len(folder) :]
            if any(part.startswith(".") for part in rel.split("/")):
                continue
            try:
                found[check_relative_path(rel)] = obj
            except ArtifactError as exc:
                raise Invalid(str(exc), param=_PARAM, code="invalid_manifest") from exc
            if len(found) > _MAX_FILES:
                raise Invalid(
                    f"s3://{bucket}/{folder} holds more than {_MAX_FILES} files",
                    param=_PARAM,
                    code="invalid_manifest",
                )
    return found


def _failure(url: str, exc: Exception) -> DomainError:
    """An S3 error as the deploy's answer: what the reference names cannot be read (400), or
    the object store is unreachable (503)."""
    if isinstance(exc, DomainError):
        return exc
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
    if code in ("NoSuchBucket", "NoSuchKey", "AccessDenied", "403", "404"):
        return Invalid(f"cannot read {url}: {code}", param=_PARAM, code="artifact_not_found")
    # The store's own error names internal hosts: it goes to the log, not to the caller.
    log.warning("s3 import of %s failed: %s", url, exc)
    return Unavailable(f"the object store could not be read for {url}; try again later")


def _declared_sha256(client: Any, bucket: str, key: str) -> str | None:
    """The sha256 the object's metadata declares, if any (checked while it is copied)."""
    head = client.head_object(Bucket=bucket, Key=key)
    declared = (head.get("Metadata") or {}).get("sha256")
    if declared is None:
        return None
    try:
        return check_sha256(declared.lower())
    except ArtifactError as exc:
        raise Invalid(
            f"s3://{bucket}/{key} declares an invalid sha256", param=_PARAM, code="invalid_manifest"
        ) from exc


def import_s3_artifact(
    settings: PlatformSettings, registry: Registry, principal: Principal, url: str
) -> ResolvedVersion:
    """Copy the model at `url` into the registry (each file hash-verified) and return its
    version; runs in a thread (it reads every byte of the model)."""
    bucket, key = parse_s3_url(url)
    if bucket not in settings.s3_import_buckets:
        raise Invalid(
            f"bucket {bucket!r} is not one the platform may deploy from (the operator lists "
            "those in MODELYARD_S3_IMPORT_BUCKETS)",
            param=_PARAM,
            code="bucket_not_allowed",
        )
    client = make_s3_client(settings.s3_endpoint_url, settings.s3_region)
    try:
        objects = _objects(client, bucket, key)
    except Exception as exc:
        raise _failure(url, exc) from exc
    if not objects:
        raise Invalid(f"nothing found at {url}", param=_PARAM, code="artifact_not_found")
    files: dict[str, dict[str, Any]] = {}
    for rel, obj in sorted(objects.items()):
        source = f"s3://{bucket}/{obj['Key']}"
        try:
            expected = _declared_sha256(client, bucket, obj["Key"])
            with closing(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"]) as body:
                blob = registry.store.put_reader(body, expected, settings.max_artifact_bytes)
        except ArtifactError as exc:  # the content is not what it says, or too large
            raise Invalid(f"{source}: {exc}", param=_PARAM, code="invalid_artifact") from exc
        except Exception as exc:
            raise _failure(source, exc) from exc
        registry.add_blob(principal.tenant_id, blob.sha256, blob.size)
        files[rel] = {"sha256": blob.sha256, "size": blob.size}
    name = registry_name(bucket, key)
    newest = registry.resolve(principal.tenant_id, name, missing_ok=True)
    if newest is not None and newest.files == {k: v["sha256"] for k, v in files.items()}:
        return newest
    return registry.create_version(principal.tenant_id, name, files, None)
