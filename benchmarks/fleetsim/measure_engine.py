"""Measure the real engine's step time vs batch size and context length on this machine.

    python benchmarks/fleetsim/measure_engine.py [--models tiny,smollm2] [--repeats 3]
        [--out benchmarks/fleetsim/step_time_<machine>.json]

Two models, two jobs:

- `tiny` (a 2-layer random Llama, tests/tiny_models.py): its weights and KV reads are
  negligible, so its step time is the engine's *host* cost: Python scheduling, input
  preparation, sampling and detokenization, per step and per sequence. A GPU host pays the same
  cost, so the fleet simulator's service model takes it from here (`host_step_s`,
  `host_per_seq_s`).
- `smollm2` (SmolLM2-135M): the same grid on a real model, so the CPU roofline (bytes moved per
  step / step time) can be read off and the shape (linear in batch, in context) checked.

Each point is the minimum over `--repeats` timings of one decode step with B sequences of
context `ctx` running (min, since the CPU is shared with other jobs: the minimum is the least
disturbed), and the prefill of one prompt of P tokens. The table is saved as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modelyard.config import EngineSettings
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.models.loader import to_hf_folder
from modelyard.engine.sampling_params import SamplingParams

BATCHES = (1, 2, 4, 8, 16, 32)
CONTEXTS = (128, 512, 1024)
PROMPTS = (128, 512, 1024, 2048)


def _engine(folder: Path, max_len: int) -> LLMEngine:
    settings = EngineSettings(
        dtype="float32",
        kv_cache_memory="3GiB",
        max_num_seqs=max(BATCHES),
        max_num_batched_tokens=max(PROMPTS) + max(BATCHES),
        max_model_len=max_len,
        enable_prefix_caching=False,
        max_tokens_cap=4096,
    )
    return LLMEngine.from_settings(folder, settings)


def decode_step_s(engine: LLMEngine, batch: int, ctx: int, repeats: int, vocab: int) -> float:
    """Min time of one decode step with `batch` sequences of about `ctx` tokens."""
    rng = np.random.default_rng(batch * 7919 + ctx)
    for i in range(batch):
        prompt = rng.integers(10, vocab, ctx).tolist()
        engine.add_request(
            f"d{batch}-{ctx}-{i}",
            prompt,
            SamplingParams(max_tokens=repeats + 4, temperature=0.0, ignore_eos=True),
        )
    while any(s.prefilling for s in engine.scheduler.running) or engine.num_waiting:
        engine.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    return min(times)


def prefill_s(engine: LLMEngine, tokens: int, repeats: int, vocab: int) -> float:
    rng = np.random.default_rng(tokens)
    times = []
    for r in range(repeats):
        prompt = rng.integers(10, vocab, tokens).tolist()
        engine.add_request(f"p{tokens}-{r}", prompt, SamplingParams(max_tokens=1, temperature=0))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t0)
    return min(times)


def fit(points: list[dict[str, float]]) -> dict[str, float]:
    """Least squares: step = a + b * batch + c * batch * ctx (seconds)."""
    x = np.array([[1.0, p["batch"], p["batch"] * p["ctx"]] for p in points])
    y = np.array([p["step_s"] for p in points])
    a, b, c = np.linalg.lstsq(x, y, rcond=None)[0]
    return {"step_s": float(a), "per_seq_s": float(b), "per_seq_token_s": float(c)}


def measure(name: str, folder: Path, repeats: int) -> dict[str, Any]:
    engine = _engine(folder, max(max(CONTEXTS), max(PROMPTS)) + 64)
    vocab = min(engine.model_config.vocab_size, 30000)
    decode_step_s(engine, 2, 64, 2, vocab)  # warm-up
    decode = [
        {"batch": b, "ctx": c, "step_s": decode_step_s(engine, b, c, repeats, vocab)}
        for c in CONTEXTS
        for b in BATCHES
    ]
    prefill = [{"tokens": p, "s": prefill_s(engine, p, repeats, vocab)} for p in PROMPTS]
    params = sum(p.numel() for p in engine.runner.model.parameters())
    for row in decode:
        ms = row["step_s"] * 1e3
        print(f"{name:8} decode B={row['batch']:>3} ctx={row['ctx']:>5}: {ms:8.2f} ms")
    for row in prefill:
        print(f"{name:8} prefill {row['tokens']:>5} tokens: {row['s'] * 1e3:8.1f} ms")
    return {"params": int(params), "decode": decode, "prefill": prefill, "fit": fit(decode)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--machine", default="epyc-zen4-2vcpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = args.out or Path(__file__).with_name(f"step_time_{args.machine}.json")
    report: dict[str, Any] = {
        "machine": f"{args.machine}: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "dtype": "float32",
        "note": "min over repeats; measured while other jobs shared the CPU",
        "models": {},
    }
    for name in args.models.split(","):
        if name == "tiny":
            sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
            from tests.tiny_models import build_model

            folder = build_model(Path(tempfile.mkdtemp()) / "tiny", max_position_embeddings=4096)
        else:
            folder = to_hf_folder(name, EngineSettings().cache_dir)
        report["models"][name] = measure(name, folder, args.repeats)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
