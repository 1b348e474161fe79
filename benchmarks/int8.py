"""Int8 (weight-only) and w8a8 (int8 activations too): weight memory, accuracy against float32,
decode speed, and the matmul kernel's speed.

1. Weight memory of the int8 model (parameters and persistent buffers, a tied head counted
   once) against the checkpoint in float32.
2. Accuracy on a fixed prompt set (10 English/code prompts, greedy, `--max-tokens` each, run
   batched in one engine per dtype): max |logit error| against float32 over the positions both
   runs reached with the same context, that error relative to the largest |logit|, top-1
   agreement at those positions, and greedy tokens equal up to each sequence's first divergence.
3. Decode speed: the engine's median step with 1, 8 and 32 sequences decoding, per mode.
4. Kernel: `aten._weight_int8pack_mm` against `F.linear` in float32 and bfloat16 for the model's
   matmul shapes, at 1 and 32 rows (median of `--repeat` calls).

    python benchmarks/int8.py                 # SmolLM2
    python benchmarks/int8.py --model PATH --max-tokens 16
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modelyard.config import EngineSettings
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.models.loader import read_model_config, to_hf_folder
from modelyard.engine.quantization import fbgemm_available, quantize_rows, weight_bytes
from modelyard.engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\n# compute the mean of",
    "Photosynthesis is the process by which",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "SELECT name FROM users WHERE",
]


def run(folder: Path, quant: str | None, dtype: str, max_tokens: int) -> tuple:
    engine = LLMEngine.from_settings(
        folder, EngineSettings(dtype=dtype, quantization=quant, kv_cache_memory="256MiB")
    )
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    records: list[tuple[tuple[int, ...], torch.Tensor]] = []
    execute = engine.runner.execute

    def recording(inputs):  # type: ignore[no-untyped-def]
        logits = execute(inputs)
        for seq, row in zip(inputs.sampling_seqs, logits, strict=True):
            records.append((tuple(seq.token_ids), row.clone()))
        return logits

    engine.runner.execute = recording  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            for d in o.deltas:
                out[o.request_id].extend(d.token_ids)
    return out, records, weight_bytes(engine.runner.model)


DECODE_BATCHES = (1, 8, 32)


def decode_step_ms(folder: Path, quant: str | None, batch: int, tokens: int = 24) -> float:
    """Median engine step (ms) while `batch` greedy sequences decode together."""
    engine = LLMEngine.from_settings(
        folder, EngineSettings(dtype="float32", quantization=quant, kv_cache_memory="256MiB")
    )
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)]), params)
    engine.step()  # the prefills
    samples = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1000


def accuracy(ref: tuple, got: tuple) -> dict[str, float]:
    ref_logits = dict(ref[1])
    pairs = [(lg, ref_logits[t]) for t, lg in got[1] if t in ref_logits]
    same = total = 0
    for rid, toks in ref[0].items():
        for a, b in zip(toks, got[0][rid], strict=True):
            if a != b:
                break
            same += 1
        total += len(toks)
    err = max((q - f).abs().max().item() for q, f in pairs)
    scale = max(f.abs().max().item() for _, f in pairs)
    return {
        "max_err": err,
        "rel_err": err / scale,
        "top1": sum(int(q.argmax() == f.argmax()) for q, f in pairs) / len(pairs),
        "greedy": same / total,
        "positions": len(pairs),
    }


def kernel_times(cfg, repeat: int) -> list[tuple[str, int, float, float, float]]:  # type: ignore[no-untyped-def]
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k)
        qw, scale = quantize_rows(w)
        for m in (1, 32):
            x = torch.randn(m, k)

            def timed(fn) -> float:  # type: ignore[no-untyped-def]
                fn()
                samples = []
                for _ in range(repeat):
                    t = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t)
                return statistics.median(samples) * 1e6

            xb, wb, sb = x.bfloat16(), w.bfloat16(), scale.bfloat16()
            t32 = timed(lambda x=x, w=w: F.linear(x, w))
            t16 = timed(lambda xb=xb, wb=wb: F.linear(xb, wb))
            t8 = timed(lambda xb=xb, qw=qw, sb=sb: torch.ops.aten._weight_int8pack_mm(xb, qw, sb))
            rows.append((name, m, t32, t16, t8))
    return rows


def accuracy_table(folder: Path, cfg, max_tokens: int) -> None:  # type: ignore[no-untyped-def]
    """Weight memory and accuracy against float32 of every mode (the first table)."""
    fp32 = run(folder, None, "float32", max_tokens)
    from safetensors import safe_open

    fp32_bytes = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                if not (cfg.tie_word_embeddings and name == "lm_head.weight"):
                    shape = st.get_slice(name).get_shape()
                    fp32_bytes += 4 * int(torch.tensor(shape).prod())
    print(
        f"\n{'run':<14} {'weights MB':>10} {'% fp32':>7} {'max err':>8} {'rel err':>8} "
        f"{'top-1':>6} {'greedy':>7}"
    )
    print(f"{'float32':<14} {fp32_bytes / 1e6:>10.1f} {100:>7.1f}")
    runs = [
        ("bfloat16", None, "bfloat16"),
        ("int8 (fp32 act)", "int8", "float32"),
        ("int8 (bf16 act)", "int8", "bfloat16"),
    ]
    if fbgemm_available():
        runs.append(("w8a8", "w8a8", "float32"))
    for label, quant, dtype in runs:
        got = run(folder, quant, dtype, max_tokens)
        a = accuracy(fp32, got)
        size = got[2] if quant else fp32_bytes // 2
        print(
            f"{label:<14} {size / 1e6:>10.1f} {100 * size / fp32_bytes:>7.1f} "
            f"{a['max_err']:>8.3f} {a['rel_err']:>8.3f} {a['top1']:>6.3f} {a['greedy']:>7.3f}"
        )
    print(f"({len(PROMPTS)} prompts x {max_tokens} greedy tokens)")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--decode-only", action="store_true", help="only the decode speed table")
    args = ap.parse_args()
    folder = to_hf_folder(args.model, EngineSettings().cache_dir)
    cfg = read_model_config(folder)
    print(
        f"model {args.model}; machine {platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    if not args.decode_only:
        accuracy_table(folder, cfg, args.max_tokens)
    print(f"\ndecode step, median ms (tokens/s) at batch {DECODE_BATCHES}, float32 activations")
    for quant in [None, "int8"] + (["w8a8"] if fbgemm_available() else []):
        cells = []
        for batch in DECODE_BATCHES:
            ms = decode_step_ms(folder, quant, batch)
            cells.append(f"{ms:7.1f} ({batch / ms * 1000:6.1f})")
        print(f"{quant or 'float32':<10} " + "  ".join(cells))
    print(
        f"\n{'matmul':<8} {'rows':>4} {'fp32 us':>9} {'bf16 us':>9} {'int8 us':>9} {'bf16/int8':>9}"
    )
    for name, m, t32, t16, t8 in kernel_times(cfg, args.repeat):
        print(f"{name:<8} {m:>4} {t32:>9.1f} {t16:>9.1f} {t8:>9.1f} {t16 / t8:>9.2f}")


if __name__ == "__main__":
    main()
