"""Cold start to first token for SmolLM2, from each cold-start layer, through the gateway.

An endpoint with `scale_to_zero` (idle after 1 s) is left to reach zero replicas; then one
streaming chat request measures the time to its first content token while a replica comes up:

  * artifact store: the node cache is emptied first (the model files are copied out of the
    registry's store and verified, and the GGUF is converted again);
  * node cache: the files (and the converted weights) are on this node (measured after the
    store runs, once their writes are flushed);
  * warm pool: a second platform keeps one idle SmolLM2 replica loaded
    (`MODELYARD_WARM_POOL={"smollm2": 1}`); the cold endpoint takes it over.

Targets: warm pool < 0.5 s, node cache < 3 s.

    python benchmarks/cold_start.py [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modelyard.engine.models.bundled import resolve_model_path
from modelyard.registry_client import RegistryClient
from tests.platform_harness import PlatformProcess, deploy, wait_status

SCALING = {
    "metric": "concurrency", "target_value": 4, "scale_to_zero": True,
    "scale_to_zero_after_idle_seconds": 1, "stable_window_seconds": 2,
    "panic_window_seconds": 1, "scale_down_delay_seconds": 1,
}  # fmt: skip


def ttft(platform: PlatformProcess, model: str) -> float:
    client = platform.openai()
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=4,
        stream=True,
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    assert first is not None
    return first


def setup(platform: PlatformProcess) -> str:
    RegistryClient(platform.url, platform.admin_key).push(resolve_model_path("smollm2"), "smollm2")
    api = platform.api()
    endpoint = deploy(api, "cold", "smollm2", wait=False, hardware={"min_replicas": 0},
                      scaling=SCALING)  # fmt: skip
    wait_status(api, endpoint, "scaled_to_zero", timeout=300)
    return endpoint


def layers_without_pool(trials: int) -> dict[str, list[float]]:
    platform = PlatformProcess(Path(tempfile.mkdtemp(prefix="cold-")) / "data").start()
    out: dict[str, list[float]] = {"artifact store": [], "node cache": []}
    try:
        endpoint = setup(platform)
        api = platform.api()
        cache = platform.data_dir / "node-cache"
        for _ in range(trials):
            shutil.rmtree(cache / "versions", ignore_errors=True)
            (cache / "versions").mkdir()
            shutil.rmtree(cache / "engine" / "converted", ignore_errors=True)
            out["artifact store"].append(ttft(platform, "cold"))
            wait_status(api, endpoint, "scaled_to_zero", timeout=120)
        # The store runs just wrote ~0.7 GB (copies, converted weights): let the disk settle so
        # the next layer is measured on its own.
        os.sync()
        for _ in range(trials):
            out["node cache"].append(ttft(platform, "cold"))
            wait_status(api, endpoint, "scaled_to_zero", timeout=120)
    finally:
        platform.stop()
    return out


def warm_pool(trials: int) -> list[float]:
    env = {"MODELYARD_WARM_POOL": json.dumps({"smollm2": 1})}
    platform = PlatformProcess(Path(tempfile.mkdtemp(prefix="warm-")) / "data", env).start()
    out = []
    try:
        endpoint = setup(platform)
        api = platform.api()
        for _ in range(trials):
            deadline = time.monotonic() + 300
            while api.get("/health").json()["warm_pool_idle"].get("smollm2", 0) < 1:
                assert time.monotonic() < deadline, "the warm pool never filled"
                time.sleep(0.2)
            out.append(ttft(platform, "cold"))
            wait_status(api, endpoint, "scaled_to_zero", timeout=120)
    finally:
        platform.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = layers_without_pool(args.trials)
    results["warm pool"] = warm_pool(args.trials)
    report: dict[str, Any] = {
        layer: {"median_s": round(statistics.median(v), 3), "runs_s": [round(x, 3) for x in v]}
        for layer, v in results.items()
    }
    print(json.dumps(report, indent=2))
    for layer, r in report.items():
        print(f"cold start to first token from the {layer}: {r['median_s']} s (median)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
