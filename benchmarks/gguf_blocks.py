"""Quantization `gguf` (the file's Q4_0/Q4_1/Q8_0 blocks read in place by `csrc/gguf_matmul.c`)
against `w8a8` and the dequantized float32 model: single-stream decode tokens/s, and the matmul
weight bytes a decode token reads (every matmul's weights once, the LM head included).

All engines are loaded in one process and decode in alternating rounds (gguf, w8a8, float32,
gguf, ...): each round one greedy sequence of `--tokens` tokens after a short prompt; the
figure per mode is the median over rounds of decode tokens / decode time (the prefill step
left out). Then the kernel alone: each mode's matmul at one row for the model's shapes.

    python benchmarks/gguf_blocks.py                   # SmolLM2's Q4_1 GGUF
    python benchmarks/gguf_blocks.py --rounds 7 --tokens 64
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modelyard.config import EngineSettings
from modelyard.engine.cpu_kernels import build_kernels
from modelyard.engine.gguf_linear import GGUFLinear
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.models.packed_linear import PackedLinear
from modelyard.engine.quantization import Int8Linear
from modelyard.engine.sampling_params import SamplingParams

MODES = ("gguf", "gguf+w8a8", "w8a8", None)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def matmul_bytes(model: nn.Module) -> int:
    """Bytes of matmul weights a decode token reads: each matmul's weights once (a tied LM head
    is its own read, though its storage is the embedding's)."""
    total = 0
    # gguf+w8a8's w8a8 copies serve only wider matmuls: a one-sequence token reads the blocks
    copies = {id(m.wide) for m in model.modules() if isinstance(m, GGUFLinear) and m.wide}
    for m in model.modules():
        if id(m) in copies:
            continue
        if isinstance(m, GGUFLinear):
            total += m.blocks.numel()
        elif isinstance(m, Int8Linear):  # int8 rows (FBGEMM's packed form: the same bytes)
            total += m.out_features * m.in_features + 4 * m.out_features
        elif isinstance(m, PackedLinear | nn.Linear):
            total += 4 * m.out_features * m.in_features
    return total


def decode_tok_s(engine: LLMEngine, tokens: int, tag: str, batch: int = 1) -> float:
    """Decode tokens/s of `batch` greedy sequences decoding together (their prefills left out)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", engine.tokenizer.encode(f"{i}. {PROMPT}"), params)
    while any(s.prefilling for s in _sequences(engine)):
        engine.step()  # the prefills (and each one's first token)
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps * batch / (time.perf_counter() - start)


def _sequences(engine: LLMEngine) -> list[Any]:
    return list(engine.scheduler.running) + list(engine.scheduler.waiting)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2", help="a GGUF file or a bundled name")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    ap.add_argument(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="avx2: every engine gets the C kernels built without AVX-512 (what an AVX2-only "
        "CPU runs; PyTorch's own kernels, FBGEMM's among them, keep this CPU's)",
    )
    args = ap.parse_args()
    engines = {
        mode: LLMEngine.from_settings(
            args.model,
            EngineSettings(dtype="float32", quantization=mode, kv_cache_memory="128MiB"),
        )
        for mode in MODES
    }
    if args.isa == "avx2":
        avx2 = build_kernels(EngineSettings().cache_dir, ("-mno-avx512f",))
        for engine in engines.values():
            engine.runner.use_kernels(avx2)
    kernels = engines["gguf"].runner.kernels
    isa = {0: "plain C", 2: "AVX2", 3: "AVX-512 VNNI"}[kernels.gguf_matmul_isa] if kernels else "-"
    print(
        f"model {args.model}; {platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; gguf matmul: {isa}; "
        f"batch {args.batch}",
        flush=True,
    )
    rates: dict[str | None, list[float]] = {mode: [] for mode in MODES}
    for r in range(args.rounds + 1):  # round 0 warms up, not counted
        for mode, engine in engines.items():
            rate = decode_tok_s(engine, args.tokens, f"{mode}-{r}", args.batch)
            if r:
                rates[mode].append(rate)
            print(f"round {r} {mode or 'float32'}: {rate:.1f} tok/s", flush=True)
    base = statistics.median(rates[None])
    print(f"\n{'mode':<10} {'tok/s':>7} {'x fp32':>7} {'MB/token':>9} {'rounds'}")
    for mode in MODES:
        med = statistics.median(rates[mode])
        mb = matmul_bytes(engines[mode].runner.model) / 1e6
        cells = " ".join(f"{x:.1f}" for x in rates[mode])
        print(f"{mode or 'float32':<10} {med:>7.1f} {med / base:>7.2f} {mb:>9.1f} {cells}")


if __name__ == "__main__":
    main()
