"""The LoRA kernel alone (`csrc/lora.c`) against the base projections it rides on.

SmolLM2-135M's shapes: 30 layers x 4 wrapped projections (qkv, o, gate_up, down), 50 slots of
random rank-`--rank` adapters on every part, 50 rows each under its own slot (a decode step of
the `benchmarks/lora.py` mixed load). Per repetition: one pass of the base linears, then one of
the LoRA updates, each timed by this thread's CPU time (on a shared machine wall time counts the
waits for a core too); one thread, so the kernel reads on one core. Prints the medians, the
adapters' bytes per pass over the LoRA time, and lora / base. `--weights`: how the slots keep the
adapters (default: `weight_dtype`'s choice for the model's dtype, as an unquantized engine's).

    python benchmarks/lora_kernel.py --dtype float32
    python benchmarks/lora_kernel.py --dtype float32 --weights int8
    python benchmarks/lora_kernel.py --dtype bfloat16 --reps 9
    python benchmarks/lora_kernel.py --weights int8 --build-flags=-mno-avx512f   # AVX2 forms
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modelyard.config import EngineSettings
from modelyard.engine import cpu_kernels
from modelyard.engine.lora.layers import SLOT_DTYPES, LoRABatch, LoRALinear

HIDDEN, INTERMEDIATE, KV, LAYERS = 576, 1536, 192, 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--adapters", type=int, default=50)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--weights", default="auto", choices=["auto", *SLOT_DTYPES])
    ap.add_argument(
        "--build-flags",
        default="",
        help="extra compiler flags for the kernels (e.g. -mno-avx512f: the AVX2 forms on an "
        "AVX-512 machine)",
    )
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    cache_dir = EngineSettings().cache_dir
    flags = tuple(args.build_flags.split())
    if flags:  # never the native build in its place: the numbers would name the wrong form
        kernels = cpu_kernels.build_kernels(cache_dir, flags)
    else:
        kernels = cpu_kernels.load_kernels(cache_dir)
    if kernels is None:
        sys.exit("the C kernels did not build here")
    kernels.matmul_threads = 1
    specs = [
        (HIDDEN, [HIDDEN, KV, KV]),
        (HIDDEN, [HIDDEN]),
        (HIDDEN, [INTERMEDIATE, INTERMEDIATE]),
        (INTERMEDIATE, [HIDDEN]),
    ]
    batch = LoRABatch()
    g = torch.Generator().manual_seed(0)
    layers: list[tuple[LoRALinear, torch.Tensor, torch.Tensor]] = []
    xs = {n: torch.randn(args.adapters, n, generator=g).to(dtype) for n in (HIDDEN, INTERMEDIATE)}
    for _ in range(LAYERS):
        for n_in, parts in specs:
            base = torch.nn.Linear(n_in, sum(parts), bias=False, dtype=dtype)
            cpu = torch.device("cpu")
            stored = None if args.weights == "auto" else SLOT_DTYPES[args.weights]
            lin = LoRALinear(base, n_in, parts, args.adapters, args.rank, batch, dtype, cpu, stored)
            for s in range(1, args.adapters + 1):
                weights = [
                    (
                        torch.randn(args.rank, n_in, generator=g) * 0.02,
                        torch.randn(p, args.rank, generator=g) * 0.02,
                    )
                    for p in parts
                ]
                lin.load_slot(s, weights)  # type: ignore[arg-type]
            layers.append((lin, xs[n_in], base(xs[n_in])))
    batch.set(list(range(1, args.adapters + 1)), torch.device("cpu"))
    assert batch.groups is not None
    kernel_args = {
        id(lin): kernels.lora_args(
            lin.lora_a,
            lin._b_pointers,
            lin.slot_weights.stride(0),
            lin._part_sizes,
            lin._part_rank,
            lin.max_rank,
            lin.slot_scales,
        )
        for lin, _, _ in layers
    }
    base_s, lora_s = [], []
    for _ in range(args.reps):
        t = time.thread_time()
        for lin, x, _ in layers:
            lin.base(x)
        base_s.append(time.thread_time() - t)
        t = time.thread_time()
        for lin, x, y in layers:
            kernels.lora_add(x, y, batch.groups, kernel_args[id(lin)])
        lora_s.append(time.thread_time() - t)
    b, lo = statistics.median(base_s), statistics.median(lora_s)
    stored = layers[0][0].slot_weights
    nbytes = sum(lin.slot_weights[1:].numel() for lin, _, _ in layers) * stored.element_size()
    print(
        f"{args.dtype} model, adapters kept in {stored.dtype}: base linears {b * 1e3:.0f} ms, "
        f"LoRA {lo * 1e3:.0f} ms CPU a pass ({nbytes / lo / 1e9:.1f} GB/s); LoRA / base "
        f"{lo / b:.3f}; reps base {[round(s * 1e3) for s in base_s]} "
        f"LoRA {[round(s * 1e3) for s in lora_s]}"
    )


if __name__ == "__main__":
    main()
