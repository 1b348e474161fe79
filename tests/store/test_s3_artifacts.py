"""The artifact store on local disk and in S3 (moto's standalone server over HTTP, started here
as a subprocess): one contract for both (streamed writes verified before they are visible,
open, has, size, list, delete), the node cache refusing an object changed in the bucket, and a
model pushed to S3 deployed by `s3://` reference through a real `modelyard serve`, serving."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.control.node_cache import NodeCache
from modelyard.control.registry import ResolvedVersion
from modelyard.control.s3_import import registry_name
from modelyard.store import artifact_s3
from modelyard.store.artifact_s3 import S3ArtifactStore, make_s3_client
from modelyard.store.artifact_store import BlobStore
from modelyard.store.artifacts import ArtifactError, IntegrityError, LocalArtifactStore
from tests.conftest import free_port
from tests.databases import skip_or_fail
from tests.platform_harness import PlatformProcess, tiny_models_env, wait_status

_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoS3:
    def __init__(self, url: str) -> None:
        self.url = url
        self.client = make_s3_client(url, "us-east-1")

    def bucket(self, name: str) -> str:
        self.client.create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[MotoS3]:
    """moto's S3 over HTTP on a free port, with dummy credentials in the environment."""
    if importlib.util.find_spec("moto") is None:
        skip_or_fail("moto is not installed (pip install 'moto[server]'): the S3 tests need it")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    os.environ.update(_AWS_ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url, timeout=1.0)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, "moto.server exited"
                assert time.monotonic() < deadline, "moto.server did not answer"
                time.sleep(0.1)
        yield MotoS3(url)
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "local":
        return LocalArtifactStore(tmp_path / "artifacts")
    s3: MotoS3 = request.getfixturevalue("moto_s3")
    bucket = s3.bucket(f"store-{time.time_ns()}")
    return S3ArtifactStore(s3.client, bucket, "pfx")


async def _chunks(data: bytes, size: int = 1 << 20) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _leftovers(store: BlobStore) -> list[str]:
    """Anything a refused write might have left: temporary files or objects, open uploads."""
    if isinstance(store, LocalArtifactStore):
        return [p.name for p in store.tmp.iterdir()]
    c = store.client
    objects = c.list_objects_v2(Bucket=store.bucket).get("Contents", [])
    uploads = c.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])
    tmp = [o["Key"] for o in objects if "/tmp/" in o["Key"]]
    return tmp + [u["Key"] for u in uploads]


# ----- one contract, both stores --------------------------------------------------------------


async def test_a_streamed_blob_is_stored_read_listed_and_deleted(store: BlobStore) -> None:
    # Over one S3 part, so the multipart path runs (and a small one for the single request).
    big = os.urandom(artifact_s3.PART_BYTES + (3 << 20))
    small = b'{"architectures": ["LlamaForCausalLM"]}'
    names = []
    for data in (big, small):
        sha = hashlib.sha256(data).hexdigest()
        blob = await store.put_stream(_chunks(data), sha, max_bytes=1 << 30)
        assert (blob.sha256, blob.size) == (sha, len(data))
        assert store.has(sha) and store.size(sha) == len(data)
        reader = store.open(sha)
        try:
            assert reader.read() == data
        finally:
            reader.close()
        store.verify(sha)
        names.append(sha)
    assert sorted(b.sha256 for b in store.list()) == sorted(names)
    again = await store.put_stream(_chunks(small), names[1], max_bytes=1 << 30)  # idempotent
    assert again.sha256 == names[1]
    store.delete(names[1])
    assert not store.has(names[1])
    assert [b.sha256 for b in store.list()] == [names[0]]
    assert _leftovers(store) == []


async def test_a_blob_that_does_not_hash_to_its_name_is_never_visible(store: BlobStore) -> None:
    data = os.urandom(artifact_s3.PART_BYTES + 1024)  # parts already sent when the hash fails
    lie = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(IntegrityError):
        await store.put_stream(_chunks(data), lie, max_bytes=1 << 30)
    assert not store.has(lie) and not store.has(hashlib.sha256(data).hexdigest())
    with pytest.raises(ArtifactError, match="larger than the limit"):
        await store.put_stream(_chunks(data), None, max_bytes=1 << 20)
    assert list(store.list()) == []
    assert _leftovers(store) == []


def test_a_reader_of_unknown_hash_is_stored_under_the_hash_it_has(
    store: BlobStore, tmp_path: Path
) -> None:
    source = tmp_path / "weights.bin"
    source.write_bytes(os.urandom(3 << 20))
    sha = hashlib.sha256(source.read_bytes()).hexdigest()
    with open(source, "rb") as f:
        blob = store.put_reader(f, None)
    assert blob.sha256 == sha and store.size(sha) == source.stat().st_size
    assert store.put_file(source).sha256 == sha  # already there
    assert [b.sha256 for b in store.list()] == [sha]
    assert _leftovers(store) == []


# ----- the node cache reads either store through one path ---------------------------------------


def test_the_node_cache_refuses_an_object_changed_in_the_bucket(
    moto_s3: MotoS3, tmp_path: Path
) -> None:
    store = S3ArtifactStore(moto_s3.client, moto_s3.bucket("cache-src"), "")
    config = tmp_path / "config.json"
    config.write_text('{"architectures": ["LlamaForCausalLM"]}')
    blob = store.put_file(config)
    version = ResolvedVersion("mv-1", "m", 1, "hf", {"config.json": blob.sha256}, blob.size)
    cache = NodeCache(tmp_path / "cache", store, 1 << 30)
    entry = cache.fetch(version)
    assert (entry.path / "config.json").read_bytes() == config.read_bytes() and not entry.hit
    cache.evict("mv-1")
    # Someone with write access to the bucket swaps the object's content under its name.
    moto_s3.client.put_object(Bucket=store.bucket, Key=store.key(blob.sha256), Body=b'{"x": 1}')
    with pytest.raises(IntegrityError, match="corrupted"):
        cache.fetch(version)
    with pytest.raises(IntegrityError):
        store.verify(blob.sha256)
    assert not (cache.versions / "mv-1").exists()  # nothing half-copied stays


# ----- deploy by s3:// reference ----------------------------------------------------------------


def _push_folder(s3: MotoS3, bucket: str, prefix: str, folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            key = f"{prefix}{path.relative_to(folder).as_posix()}"
            s3.client.upload_file(str(path), bucket, key)


@pytest.fixture(scope="module")
def s3_platform(
    moto_s3: MotoS3, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[PlatformProcess, MotoS3]]:
    store_bucket = moto_s3.bucket("modelyard-artifacts")
    moto_s3.bucket("models")
    moto_s3.bucket("private")
    _push_folder(moto_s3, "models", "tiny/v1/", models_dir / "tiny")
    _push_folder(moto_s3, "private", "tiny/", models_dir / "tiny")
    env = {
        **tiny_models_env(models_dir),
        **_AWS_ENV,
        "MODELYARD_ARTIFACT_STORE": "s3",
        "MODELYARD_S3_BUCKET": store_bucket,
        "MODELYARD_S3_PREFIX": "cluster-a",
        "MODELYARD_S3_ENDPOINT_URL": moto_s3.url,
        "MODELYARD_S3_IMPORT_BUCKETS": json.dumps(["models"]),
    }
    p = PlatformProcess(tmp_path_factory.mktemp("data"), env).start()
    try:
        yield p, moto_s3
    finally:
        p.stop()


def _deploy(api: httpx.Client, artifact: str, name: str = "tiny-s3") -> httpx.Response:
    return api.post(
        "/v1/models/deploy",
        json={"model_name": name, "model_artifact": artifact, "public": True},
    )


def test_a_model_pushed_to_s3_and_deployed_by_reference_serves(
    s3_platform: tuple[PlatformProcess, MotoS3],
) -> None:
    platform, s3 = s3_platform
    api = platform.api()
    r = _deploy(api, "s3://models/tiny/v1/")
    assert r.status_code == 202, r.text
    endpoint = wait_status(api, r.json()["endpoint_id"], "ready")
    assert endpoint["model_artifact"] == f"{registry_name('models', 'tiny/v1/')}:1"
    answer = platform.openai().chat.completions.create(
        model="tiny-s3", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.choices[0].message.content is not None and answer.usage is not None
    # The registry holds the version, its blobs in the platform's bucket under its prefix.
    models = api.get("/v1/registry/models").json()["data"]
    [model] = [m for m in models if m["name"] == "s3.models.tiny.v1"]
    files = model["versions"][0]["files"]
    assert "config.json" in files
    keys = {o["Key"] for o in s3.client.list_objects_v2(Bucket="modelyard-artifacts")["Contents"]}
    for meta in files.values():
        assert f"cluster-a/blobs/sha256/{meta['sha256'][:2]}/{meta['sha256']}" in keys
    # Deploying the same prefix again reuses the version instead of making another.
    again = _deploy(api, "s3://models/tiny/v1", name="tiny-s3-again")
    assert again.status_code == 202, again.text
    models = api.get("/v1/registry/models").json()["data"]
    assert [len(m["versions"]) for m in models if m["name"] == "s3.models.tiny.v1"] == [1]


def test_s3_references_are_checked_at_deploy(
    s3_platform: tuple[PlatformProcess, MotoS3],
) -> None:
    platform, s3 = s3_platform
    api = platform.api()
    refused = _deploy(api, "s3://private/tiny/")
    assert refused.status_code == 400
    error: dict[str, Any] = refused.json()["error"]
    assert "'private'" in error["message"] and error["param"] == "model_artifact"
    assert error["code"] == "bucket_not_allowed"
    missing = _deploy(api, "s3://models/nothing-here/")
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "artifact_not_found"
    # An object whose declared sha256 does not match its content is refused by hash.
    s3.client.put_object(
        Bucket="models",
        Key="liar/config.json",
        Body=b'{"architectures": ["LlamaForCausalLM"]}',
        Metadata={"sha256": hashlib.sha256(b"other").hexdigest()},
    )
    lied = _deploy(api, "s3://models/liar/")
    assert lied.status_code == 400, lied.text
    assert "hashes to" in lied.json()["error"]["message"]
