"""The engine's own adapter load time: read a PEFT adapter from disk, check it, write it into a
LoRA slot (`LoRAManager.try_acquire` on a miss), as the fleet simulator's adapter model uses.

    python benchmarks/fleetsim/measure_adapter_load.py        # SmolLM2, rank 8, all projections

Random rank-8 adapters on all 7 projections are written to a temporary folder (from the page
cache, as from a warm node cache); each round loads every adapter into a 4-slot engine, so
every load after the fourth also evicts. Prints the adapter size, per-load times (median, min)
and the bytes/s they imply, and writes `adapter_load_<machine>.json` beside this file.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lora import write_adapter  # benchmarks/lora.py

from modelyard.config import EngineSettings
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.lora.adapter import projection_shapes
from modelyard.engine.models.loader import read_model_config, to_hf_folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--adapters", type=int, default=12)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--machine", default="epyc-2vcpu")
    args = ap.parse_args()
    settings = EngineSettings(max_loras=4, max_lora_rank=args.rank, kv_cache_memory="256MiB")
    cfg = read_model_config(to_hf_folder(args.model, settings.cache_dir))
    engine = LLMEngine.from_settings(args.model, settings)
    lora = engine.runner.lora
    assert lora is not None
    times: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        shapes = projection_shapes(cfg)
        names = [f"a{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            write_adapter(Path(tmp) / name, shapes, cfg.num_hidden_layers, args.rank, i)
            lora.register(name, Path(tmp) / name)
        size = (Path(tmp) / names[0] / "adapter_model.safetensors").stat().st_size
        for _ in range(args.rounds):
            for name in names:
                started = time.perf_counter()
                assert lora.try_acquire(f"r-{name}", name, live=())
                times.append(time.perf_counter() - started)
    med, low = statistics.median(times), min(times)
    out = {
        "model": args.model,
        "rank": args.rank,
        "adapter_bytes": size,
        "loads": len(times),
        "load_s_median": med,
        "load_s_min": low,
        "bytes_per_s_median": size / med,
        "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(out, indent=1))
    Path(__file__).with_name(f"adapter_load_{args.machine}.json").write_text(
        json.dumps(out, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
