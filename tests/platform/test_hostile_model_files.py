"""Issue 27, finding 1, on `modelyard serve` in both store modes: a tenant admin's model files are
checked at push with hard limits, off the platform's event loop, and their size recorded then.

The hostile file (a ~2.5 MB safetensors header of 600 dimensions of 4,300 digits each, whose
product froze the platform for tens of seconds when a replica was sized) is refused at push with
a 400 naming the file and the limit, as an LLM and as an embedding model, while `/health` keeps
answering; nothing is stored. A good push records its exact parameter count, and replicas and the
encoder host are sized from it. A version pushed before the count was recorded (NULL) has it
computed once, off the loop, with the same bounded parser, and stored; a hostile one of those
fails its endpoint with the same message instead of freezing the platform.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.orm import Session

from modelyard.store.artifacts import scan_folder
from modelyard.store.tables import Model, ModelVersion
from tests.hostile_files import exact_numel, hostile_safetensors
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    platform_running,
    tiny_models_env,
    wait_status,
)
from tests.tiny_encoders import build_embedding_model
from tests.tiny_models import build_model

# A hostile input must not hold any process's event loop (tests/loop_stalls.py).
pytestmark = pytest.mark.usefixtures("no_loop_stalls")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama and a tiny embedding model, and each with its weights made hostile."""
    root = tmp_path_factory.mktemp("hostile")
    good = {
        "llm": build_model(root / "llm", "llama"),
        "embedding": build_embedding_model(root / "emb"),
    }
    out = dict(good)
    for kind, folder in good.items():
        bad = root / f"{kind}-hostile"
        shutil.copytree(folder, bad)
        for weights in bad.glob("*.safetensors"):
            weights.write_bytes(hostile_safetensors())
        out[f"{kind}-hostile"] = bad
    return out


@pytest.fixture(scope="module")
def platform(
    platform_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> Iterator[PlatformProcess]:
    models = tmp_path_factory.mktemp("models")
    env = {**platform_env, **tiny_models_env(models)}
    with platform_running(tmp_path_factory.mktemp("data"), env) as p:
        yield p


@pytest.fixture(scope="module")
def tenant_admin(platform: PlatformProcess) -> httpx.Client:
    admin = platform.api()
    tenant = create_tenant(admin, "model-pusher")
    return platform.api(create_key(admin, tenant, scopes=["admin", "inference"])["key"])


def push(api: httpx.Client, folder: Path, name: str) -> httpx.Response:
    """What `modelyard models push` does: every blob, then the version's manifest."""
    manifest: dict[str, dict[str, Any]] = {}
    for rel, path in scan_folder(folder):
        content = path.read_bytes()
        sha = hashlib.sha256(content).hexdigest()
        r = api.put(f"/v1/blobs/{sha}", content=content)
        assert r.status_code == 201, r.text
        manifest[rel] = {"sha256": sha, "size": len(content)}
    return api.post(f"/v1/registry/models/{name}/versions", json={"files": manifest})


def while_health_answers(platform: PlatformProcess, work: Any) -> tuple[Any, list[int]]:
    """Run `work()` in a thread, asking `/health` all the while (and once after); the statuses
    of every probe come back with what `work` returned. A probe the platform does not answer
    raises, failing the test."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    statuses = []
    with httpx.Client(base_url=platform.url, timeout=5.0) as probe:
        while thread.is_alive():
            statuses.append(probe.get("/health").status_code)
        thread.join()
        statuses.append(probe.get("/health").status_code)
    return result[0], statuses


@pytest.mark.parametrize("kind", ["llm", "embedding"])
def test_a_hostile_safetensors_header_is_refused_at_push(
    platform: PlatformProcess, tenant_admin: httpx.Client, folders: dict[str, Path], kind: str
) -> None:
    name = f"hostile-{kind}"
    r, statuses = while_health_answers(
        platform, lambda: push(tenant_admin, folders[f"{kind}-hostile"], name)
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_model_file" and error["param"] == "files", error
    assert "'model.safetensors'" in error["message"] and "limit 20 digits" in error["message"]
    assert statuses and set(statuses) == {200}
    # Nothing was stored: no model, so nothing to deploy.
    listed = tenant_admin.get("/v1/registry/models").json()["data"]
    assert name not in {m["name"] for m in listed}
    r = tenant_admin.post("/v1/models/deploy", json={"model_name": name, "model_artifact": name})
    assert r.status_code == 404, r.text


@pytest.mark.parametrize("kind", ["llm", "embedding"])
def test_a_good_push_records_its_exact_size_and_serves(
    platform: PlatformProcess, tenant_admin: httpx.Client, folders: dict[str, Path], kind: str
) -> None:
    name = f"good-{kind}"
    r = push(tenant_admin, folders[kind], name)
    assert r.status_code == 201, r.text
    assert r.json()["param_count"] == exact_numel(folders[kind]) > 0
    listed = {m["name"]: m for m in tenant_admin.get("/v1/registry/models").json()["data"]}
    assert listed[name]["versions"][0]["param_count"] == exact_numel(folders[kind])
    deploy(tenant_admin, name, name)  # sized from the recorded count, and serving
    if kind == "llm":
        body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert tenant_admin.post("/v1/chat/completions", json=body).status_code == 200
    else:
        r = tenant_admin.post("/v1/embeddings", json={"model": name, "input": "hello"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) > 0, r.text


def database(platform: PlatformProcess) -> Any:
    url = platform.env.get("MODELYARD_DATABASE_URL") or (
        f"sqlite:///{platform.data_dir / 'modelyard.db'}"
    )
    return create_engine(url)


def forget_param_count(platform: PlatformProcess, model_name: str) -> None:
    """Make the version look pushed before the count was recorded (the migration's NULL)."""
    engine = database(platform)
    with engine.begin() as conn:
        conn.execute(
            text(
                "update model_versions set param_count = null where model_id in "
                "(select id from models where name = :name)"
            ),
            {"name": model_name},
        )
    engine.dispose()


def test_a_version_pushed_before_the_count_has_it_computed_once_and_stored(
    platform: PlatformProcess, tenant_admin: httpx.Client, folders: dict[str, Path]
) -> None:
    r = push(tenant_admin, folders["llm"], "legacy-llm")
    assert r.status_code == 201, r.text
    forget_param_count(platform, "legacy-llm")
    listed = {m["name"]: m for m in tenant_admin.get("/v1/registry/models").json()["data"]}
    assert listed["legacy-llm"]["versions"][0]["param_count"] is None
    deploy(tenant_admin, "legacy-llm", "legacy-llm")
    listed = {m["name"]: m for m in tenant_admin.get("/v1/registry/models").json()["data"]}
    assert listed["legacy-llm"]["versions"][0]["param_count"] == exact_numel(folders["llm"])


def test_a_hostile_version_pushed_before_the_checks_fails_its_endpoint_not_the_platform(
    platform: PlatformProcess, tenant_admin: httpx.Client, folders: dict[str, Path]
) -> None:
    """Stands for a hostile version already in a database when the platform is upgraded: its
    row is written as such a version's was (the files stored, no count), and its deploy
    sizes it with the bounded parser, off the loop."""
    r = push(tenant_admin, folders["llm"], "legacy-hostile")
    assert r.status_code == 201, r.text
    content = hostile_safetensors()
    sha = hashlib.sha256(content).hexdigest()
    assert tenant_admin.put(f"/v1/blobs/{sha}", content=content).status_code == 201
    engine = database(platform)
    with Session(engine) as s, s.begin():  # the version's weights replaced by the hostile file
        version = s.scalars(
            select(ModelVersion).join(Model).where(Model.name == "legacy-hostile")
        ).one()
        hostile = {"sha256": sha, "size": len(content)}
        files = {**version.manifest["files"], "model.safetensors": hostile}
        version.manifest = {**version.manifest, "files": files}
        version.param_count = None
    engine.dispose()

    def deploy_and_fail() -> dict:
        endpoint = deploy(tenant_admin, "legacy-hostile", "legacy-hostile", wait=False)
        return wait_status(tenant_admin, endpoint, "failed")

    body, statuses = while_health_answers(platform, deploy_and_fail)
    assert "'model.safetensors'" in body["status_message"], body
    assert "limit 20 digits" in body["status_message"], body
    assert set(statuses) == {200}
