"""LoRA adapters pushed to the registry against a base model and served from the node cache.

`modelyard models push ADAPTER --name N --base BASE` records a PEFT folder as an adapter of a
registry model; an endpoint deployed from that model with LoRA slots serves it by its own name
and as `<endpoint model>:<N>` (an adapter pushed after the endpoint is ready too), with greedy
tokens equal to the base with the adapter merged by `peft`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from modelyard.registry_client import RegistryClient
from tests.engine.test_lora import PROMPT, make_adapter, merged_greedy
from tests.parity import make_engine
from tests.platform_harness import PlatformProcess, deploy, tiny_models_env
from tests.tiny_models import build_model

pytest.importorskip("peft")


def cli_push(platform: PlatformProcess, folder: Path, name: str, base: str | None) -> str:
    cmd = [sys.executable, "-m", "modelyard.cli", "models", "push", str(folder), "--name", name]
    cmd += ["--url", platform.url, "--api-key", platform.admin_key]
    if base:
        cmd += ["--base", base]
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, timeout=120)
    return out.stdout + out.stderr


def test_registry_adapters_served_by_name(tmp_path: Path) -> None:
    root = tmp_path / "models"
    base = build_model(root / "base", "llama")
    a1 = make_adapter(base, tmp_path / "ad" / "a1", 1, r=4, lora_alpha=8,
                      target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
    a2 = make_adapter(base, tmp_path / "ad" / "a2", 2, r=8, lora_alpha=8,
                      target_modules=["k_proj", "o_proj", "up_proj"])  # fmt: skip
    platform = PlatformProcess(tmp_path / "data", tiny_models_env(root)).start()
    try:
        admin = platform.api()
        RegistryClient(platform.url, platform.admin_key).push(base, "tiny-base")
        out = cli_push(platform, a1, "support-bot", "tiny-base")
        assert "pushed support-bot:1 (lora" in out, out
        assert "base_model" in cli_push(platform, a1, "orphan", None)  # no base: refused
        assert "not a model" in cli_push(platform, a1, "orphan", "nope")
        models = {m["name"]: m for m in admin.get("/v1/registry/models").json()["data"]}
        assert models["support-bot"]["versions"][0]["base_model"] == "tiny-base"
        assert "orphan" not in models
        # The platform fills lora_registry_dir in; a deploy body may not.
        body = {"model_name": "x", "model_artifact": "tiny-base",
                "engine": {"max_loras": 1, "lora_registry_dir": "/"}}  # fmt: skip
        r = admin.post("/v1/models/deploy", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "engine.lora_registry_dir"

        deploy(admin, "tiny", "tiny-base", engine={"max_loras": 1, "max_lora_rank": 8})
        client = platform.openai()
        tok = make_engine(base, block_size=4).tokenizer

        def text(model: str) -> str:
            out = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return out.choices[0].text

        ref1 = tok.decode(merged_greedy(base, a1, PROMPT, 6))
        assert text("support-bot") == ref1  # the adapter's own registry name
        assert text("tiny:support-bot") == ref1  # `<endpoint model>:<adapter>`
        assert text("tiny") == tok.decode(merged_greedy(base, None, PROMPT, 6))
        # Pushed while the endpoint serves: served at once (one slot: a1 gives way).
        assert "pushed legal-bot:1 (lora" in cli_push(platform, a2, "legal-bot", "tiny-base")
        assert text("legal-bot") == tok.decode(merged_greedy(base, a2, PROMPT, 6))
        assert text("support-bot") == ref1
        with pytest.raises(openai.NotFoundError):
            text("tiny-base")  # a registry model no endpoint serves by that name
    finally:
        platform.stop()
