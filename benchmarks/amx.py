"""w8a8 on AMX tiles against the AVX-512 VNNI product, in one process, rounds alternating.

1. Kernel: every matmul of SmolLM2's 30 decoder layers (120 weight matrices, each its own
   memory, so the weights stream as in a step) at 1 to 512 rows: milliseconds per pass with
   the AMX copies and without (`CpuKernels.int8_matmul`, best of 5 passes).
2. Engine: the default load of SmolLM2's bundled Q4_1 GGUF (what `modelyard worker` serves),
   closed loops of `--concurrency` greedy requests (a 70-token prompt, 128 tokens, EOS
   ignored): output tokens/s, the median decode step and the mean step that carries prefills,
   once with the layers' AMX copies and once with them dropped (the VNNI product).

    python benchmarks/amx.py                     # concurrency 1, 8, 32; 2 rounds
    python benchmarks/amx.py --rounds 3 --concurrency 8 32

Needs a CPU with AMX (Intel Sapphire Rapids and later); exits with a message elsewhere.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import _bundled_gguf
from modelyard.config import EngineSettings
from modelyard.engine import loading
from modelyard.engine.client import served_settings
from modelyard.engine.cpu_kernels import CpuKernels, load_kernels
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.quantization import Int8Linear
from modelyard.engine.sampling_params import SamplingParams

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2: q|k|v, o, gate|up, down


def kernel_table(kernels: CpuKernels, rounds: int) -> None:
    torch.manual_seed(0)
    layers = []
    for _ in range(30):
        for n, k in SHAPES:
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            layers.append((w, w.sum(dim=1, dtype=torch.int32), torch.rand(n), kernels.amx_pack(w)))
    print("\nrows | VNNI ms / pass | AMX ms / pass | AMX speed-up")
    for rows in (1, 4, 8, 16, 32, 128, 512):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        best = {False: float("inf"), True: float("inf")}
        for _ in range(rounds):
            for amx in (False, True):
                for _ in range(5):
                    started = time.perf_counter()
                    for w, sums, scale, packed in layers:
                        x = xs[w.shape[1]]
                        kernels.int8_matmul(x, w, sums, scale, None, None, packed if amx else None)
                    best[amx] = min(best[amx], time.perf_counter() - started)
        print(
            f"{rows} | {1e3 * best[False]:.2f} | {1e3 * best[True]:.2f} | "
            f"{best[False] / best[True]:.2f}x"
        )


def closed_loop(engine: LLMEngine, concurrency: int, requests: int) -> dict[str, float]:
    rng = random.Random(0)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    sent = 0

    def send() -> None:
        nonlocal sent
        engine.add_request(f"r{sent}", [rng.randrange(100, 40000) for _ in range(70)], params)
        sent += 1

    for _ in range(min(concurrency, requests)):
        send()
    decode: list[float] = []
    mixed: list[float] = []
    done = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        prompt_tokens = engine.stats.prompt_tokens
        t = time.perf_counter()
        outputs = engine.step()
        (mixed if engine.stats.prompt_tokens > prompt_tokens else decode).append(
            time.perf_counter() - t
        )
        for out in outputs:
            if out.finished:
                done += 1
                if sent < requests:
                    send()
    wall = time.perf_counter() - started
    return {
        "tok_s": done * 128 / wall,
        "decode_ms": 1e3 * statistics.median(decode),
        "prefill_ms": 1e3 * statistics.mean(mixed) if mixed else 0.0,
    }


def set_amx(engine: LLMEngine, copies: dict[Int8Linear, torch.Tensor | None], on: bool) -> None:
    for layer, copy in copies.items():
        layer.amx_weight = copy if on else None
    engine.runner.model.one_call.forget()  # the C step holds the copies' addresses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    kernels = load_kernels(EngineSettings().cache_dir)
    if kernels is None or not kernels.int8_amx:
        sys.exit("no AMX here (or the OS did not grant it): nothing to compare")
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          "torch threads")  # fmt: skip
    kernel_table(kernels, args.rounds)

    gguf = str(_bundled_gguf())
    settings = EngineSettings(max_num_seqs=64)
    engine = LLMEngine.from_settings(
        gguf, served_settings(settings, loading.choice_for(gguf, settings))
    )
    print(f"\nengine: {engine.numerics}")
    copies = {m: m.amx_weight for m in engine.runner.model.modules() if isinstance(m, Int8Linear)}
    print("\nconcurrency | round | form | tok/s | decode step p50 ms | step with prefill ms")
    results: dict[tuple[int, bool], list[float]] = {}
    for c in args.concurrency:
        for r in range(args.rounds):
            for amx in (r % 2 == 0, r % 2 != 0):  # alternate which goes first
                set_amx(engine, copies, amx)
                res = closed_loop(engine, c, 3 * c)
                results.setdefault((c, amx), []).append(res["tok_s"])
                form = "AMX" if amx else "VNNI"
                print(f"{c} | {r} | {form} | {res['tok_s']:.1f} | {res['decode_ms']:.2f} | "
                      f"{res['prefill_ms']:.1f}")  # fmt: skip
    print("\nconcurrency | AMX / VNNI tok/s (median of rounds)")
    for c in args.concurrency:
        amx, vnni = statistics.median(results[c, True]), statistics.median(results[c, False])
        print(f"{c} | {amx / vnni:.2f}x ({amx:.1f} vs {vnni:.1f})")


if __name__ == "__main__":
    main()
