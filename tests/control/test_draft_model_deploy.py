"""A deploy with a draft model (`engine.speculative_model`) is checked at deploy: a draft of
another vocabulary (against a registry version or a server path), one outside the allowed roots,
or one that does not exist is a 400 naming the field; a draft of the same tokenizer deploys and
serves, its greedy answer the same as without speculation."""

from __future__ import annotations

from pathlib import Path

from modelyard.registry_client import RegistryClient
from tests.platform_harness import PlatformProcess, deploy, tiny_models_env
from tests.tiny_models import build_model

FIELD = "engine.speculative_model"


def test_draft_model_checked_at_deploy(tmp_path: Path) -> None:
    root = tmp_path / "models"
    target = build_model(root / "target", "llama")
    draft = build_model(root / "draft", "llama", seed=3, num_hidden_layers=1)
    wide = build_model(root / "wide", "llama", vocab_size=512)
    platform = PlatformProcess(tmp_path / "data", tiny_models_env(root)).start()
    try:
        admin = platform.api()
        RegistryClient(platform.url, platform.admin_key).push(target, "tiny-target")

        def refused(artifact: str, engine: dict[str, object], code: str) -> None:
            body = {"model_name": "x", "model_artifact": artifact, "engine": engine}
            r = admin.post("/v1/models/deploy", json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["param"], error["code"]) == (FIELD, code), error

        spec = {"speculative": "draft"}
        for artifact in ("tiny-target", str(target)):  # a registry version, a server path
            refused(artifact, {**spec, "speculative_model": str(wide)}, "draft_model_mismatch")
        refused("tiny-target", {**spec, "speculative_model": "relative/d"}, "path_not_allowed")
        missing = str(root / "missing")
        refused("tiny-target", {**spec, "speculative_model": missing}, "artifact_not_found")
        r = admin.post(
            "/v1/models/deploy",
            json={"model_name": "x", "model_artifact": "tiny-target", "engine": spec},
        )
        assert r.status_code == 400 and "speculative_model" in r.json()["error"]["message"]
        assert admin.get("/v1/endpoints").json()["data"] == []  # nothing was created

        plain = deploy(admin, "plain", "tiny-target")
        with_draft = deploy(
            admin, "drafted", "tiny-target", engine={**spec, "speculative_model": str(draft)}
        )
        assert plain and with_draft
        answers = []
        for model in ("plain", "drafted"):
            body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            r = admin.post("/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["text"])
        assert answers[0] == answers[1]
    finally:
        platform.stop()
