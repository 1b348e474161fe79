"""Multi-LoRA: throughput of a load mixing many adapters against the same load on the base.

One engine (SmolLM2 by default) with `max_loras` = the adapter count; random PEFT-format
adapters (rank `--rank` on q/k/v/o and gate/up/down) are written to a temporary folder. Two
loads of `--requests` requests, each decoding exactly `--max-tokens` tokens (EOS ignored) after a
`--prompt-len` prompt, all added before the first step:

- base: every request on the base model;
- mixed: request i under adapter i % adapters (with 50 requests and 50 adapters, every row of
  every step has its own adapter), adapters already in their slots (a warm-up round loads them).

Rounds alternate (base, mixed, base, mixed, ...) in one process; the table gives output tokens/s
per round and the median ratio mixed / base, and the same ratio by the process's CPU seconds
(on a machine shared with other jobs, wall time also counts the waits for a core).
`--kernels c,pytorch` runs the mixed load once per form of the LoRA update in each round (c:
modelyard's C kernel, `csrc/lora.c`, the CPU default where it builds; pytorch: per-row gathered
bmm / per-adapter matmul pairs, the path without a compiler and on other devices).

    python benchmarks/lora.py                        # SmolLM2, 50 adapters, 50 requests
    python benchmarks/lora.py --adapters 8 --requests 32 --rounds 2
    python benchmarks/lora.py --kernels c,pytorch --max-tokens 16
    python benchmarks/lora.py --lora-dtype float16   # the adapters' slots in float16, not int8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modelyard.config import EngineSettings
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.lora.adapter import projection_shapes
from modelyard.engine.models.loader import read_model_config, to_hf_folder
from modelyard.engine.sampling_params import SamplingParams

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(
    folder: Path,
    shapes: dict[str, tuple[int, int]],
    layers: int,
    rank: int,
    seed: int,
    targets: tuple[str, ...] = MODULES,
) -> None:
    """A PEFT-format LoRA adapter with random weights (what `peft` saves, without loading HF)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj in targets:
            out_f, in_f = shapes[proj]
            kind = "self_attn" if proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{i}.{kind}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))


def run_load(
    engine: LLMEngine, prompts: list[list[int]], loras: list[str | None], max_tokens: int
) -> tuple[int, float, float]:
    """Tokens, wall seconds and this process's CPU seconds (on a shared machine the CPU time
    shows what the wall time hides: time the process waited for a core)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora=lora)
    tokens = 0
    started, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += sum(len(d.token_ids) for d in out.deltas)
    return tokens, time.perf_counter() - started, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--adapters", type=int, default=50)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--targets",
        default=",".join(MODULES),
        help="projections each adapter targets (PEFT's default for Llama: q_proj,v_proj)",
    )
    ap.add_argument("--kernels", default="c", help="c, pytorch, or both (c,pytorch)")
    ap.add_argument(
        "--lora-dtype",
        default="auto",
        choices=["auto", "int8", "float16", "bfloat16", "float32"],
        help="the engine's lora_weight_dtype (auto: int8 under a quantized base on the C kernels)",
    )
    args = ap.parse_args()
    kernels = args.kernels.split(",")

    settings = EngineSettings(
        dtype=args.dtype,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
        max_num_seqs=max(64, args.requests),
        kv_cache_memory="512MiB",
        lora_weight_dtype=args.lora_dtype,
    )
    folder = to_hf_folder(args.model, settings.cache_dir)
    cfg = read_model_config(folder)
    engine = LLMEngine.from_settings(args.model, settings)
    lora = engine.runner.lora
    assert lora is not None
    with tempfile.TemporaryDirectory() as tmp:
        shapes = projection_shapes(cfg)
        names = [f"adapter{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            targets = tuple(args.targets.split(","))
            write_adapter(Path(tmp) / name, shapes, cfg.num_hidden_layers, args.rank, i, targets)
            lora.register(name, Path(tmp) / name)
        g = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(100, cfg.vocab_size - 100, (args.prompt_len,), generator=g).tolist()
            for _ in range(args.requests)
        ]
        mixed = [names[i % args.adapters] for i in range(args.requests)]
        base: list[str | None] = [None] * args.requests
        run_load(engine, prompts, mixed, 2)  # warm-up: every adapter into its slot
        run_load(engine, prompts, base, 2)
        rows = []
        loads = [("base", base, "c")] + [(f"mixed-{k}", mixed, k) for k in kernels]
        projections = [lin for layer in lora._layers for lin in layer.values()]
        c_kernels = engine.runner.kernels
        if "c" in kernels and c_kernels is None:
            sys.exit("the C kernels did not build here (see the log): drop `c` from --kernels")
        for r in range(args.rounds):
            for label, loras, kernel in loads:
                for lin in projections:
                    lin.kernels = c_kernels if kernel == "c" else None
                tokens, seconds, cpu = run_load(engine, prompts, loras, args.max_tokens)
                rows.append((r, label, tokens, seconds, tokens / seconds, cpu))
                print(f"round {r} {label}: {tokens} tokens in {seconds:.2f} s", flush=True)
    print(
        f"model {args.model} ({engine.runner.dtype}, adapters in {lora.weight_dtype}), "
        f"{args.requests} requests x {args.max_tokens} "
        f"tokens, prompt {args.prompt_len}, {args.adapters} adapters of rank {args.rank} on "
        f"{args.targets}, "
        f"{len(set(mixed))} distinct in the mixed load; machine: {platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'round':>5} {'load':>15} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'CPU s':>8}")
    for r, label, tokens, seconds, rate, cpu in rows:
        print(f"{r:>5} {label:>15} {tokens:>7} {seconds:>8.2f} {rate:>8.1f} {cpu:>8.2f}")
    width = len(loads)
    for k, kernel in enumerate(kernels, start=1):
        ratios = [rows[i + k][4] / rows[i][4] for i in range(0, len(rows), width)]
        per_round = ", ".join(f"{x:.3f}" for x in ratios)
        median = statistics.median(ratios)
        print(f"mixed ({kernel}) / base per round: {per_round}; median {median:.3f}")
        by_cpu = [rows[i][5] / rows[i + k][5] for i in range(0, len(rows), width)]
        print(
            f"  the same by CPU seconds (base CPU s / mixed CPU s): "
            f"{', '.join(f'{x:.3f}' for x in by_cpu)}; median {statistics.median(by_cpu):.3f}"
        )
    print(f"adapter loads {lora.loads}, evictions {lora.evictions}")


if __name__ == "__main__":
    main()
