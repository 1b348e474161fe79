"""float32 vs bfloat16 KV cache under int8 weights: decode step time on this CPU, A/B in one run.

Two engines on the same model and quantization (default: SmolLM2's bundled GGUF, w8a8), one
with a float32 KV cache and one with a bfloat16 one, each holding `batch` greedy sequences
with prompts of `--prompt-len` tokens. Their decode steps alternate (A, B, B, A, ...), so a
shared machine's drift hits both alike; the median step time of each and their ratio are
printed per batch size. What `engine/defaults.py`'s KV rule is measured by.

    python benchmarks/kv_cache_dtype.py
    python benchmarks/kv_cache_dtype.py --batches 1,8,32 --prompt-len 400 --steps 40
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from modelyard.config import EngineSettings
from modelyard.engine.defaults import cpu_features
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.models.loader import to_hf_folder
from modelyard.engine.sampling_params import SamplingParams


def engine_with(folder: Path, kv: str, quantization: str, threads: int) -> LLMEngine:
    settings = EngineSettings(
        dtype="float32",
        quantization=quantization,  # type: ignore[arg-type]
        kv_cache_dtype=kv,  # type: ignore[arg-type]
        kv_cache_memory="512MiB",
        num_threads=threads,
        max_num_seqs=64,
    )
    return LLMEngine.from_settings(folder, settings)


def fill(engine: LLMEngine, batch: int, prompt_len: int, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"{seed}-{i}", prompt, params)
    while engine.scheduler.waiting or any(s.prefilling for s in engine.scheduler.running):
        engine.step()  # the prefills, until every sequence decodes


def timed_step(engine: LLMEngine) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quantization", default="w8a8", choices=["w8a8", "int8", "none"])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    folder = to_hf_folder(args.model, EngineSettings().cache_dir)
    engines = {kv: engine_with(folder, kv, args.quantization, args.threads) for kv in KV}
    rows = []
    for batch in args.batches:
        for engine in engines.values():
            fill(engine, batch, args.prompt_len, args.steps, seed=batch)
        samples: dict[str, list[float]] = {kv: [] for kv in KV}
        for step in range(args.steps):
            order = KV if step % 2 == 0 else KV[::-1]
            for kv in order:
                samples[kv].append(timed_step(engines[kv]))
        for engine in engines.values():  # finish the rest
            while engine.has_unfinished():
                engine.step()
        f32, bf16 = (statistics.median(samples[kv]) * 1000 for kv in KV)
        row = {
            "batch": batch,
            "prompt_len": args.prompt_len,
            "float32_ms": round(f32, 2),
            "bfloat16_ms": round(bf16, 2),
            "bfloat16_speedup": round(f32 / bf16, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"cpu": cpu_features().label, "machine": platform.processor(), "rows": rows}))


KV = ("float32", "bfloat16")

if __name__ == "__main__":
    main()
