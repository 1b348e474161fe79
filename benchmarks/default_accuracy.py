"""Accuracy of the engine's default numerics on a quantized GGUF against float32, teacher-forced.

The model file (default: SmolLM2's bundled Q4_1 GGUF) is loaded twice: as float32 (the GGUF
dequantized, `quantization: none`, float32 KV cache) and with no setting (what
`engine/defaults.py` chooses on this CPU), plus any `--variant QUANT/KV` given. Both read the
same real text (this repository's README, its first `--tokens` tokens): at every position each
predicts the next token from the text so far (teacher forcing: one early difference does not
derail the rest). Reported per variant: top-1 agreement with float32, max |logit error| and the
largest |logit| (its scale), and how often each predicts the text's own next token.

Contexts run in waves of `block_size` requests that share the cached prefix before them, so
each request computes at most two blocks of new tokens.

    python benchmarks/default_accuracy.py
    python benchmarks/default_accuracy.py --tokens 300 --variant w8a8/bfloat16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from modelyard.config import EngineSettings
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.models.bundled import resolve_model_path
from modelyard.engine.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = 16


def next_token_logits(engine: LLMEngine, text: list[int], start: int) -> torch.Tensor:
    """Row k: the logits after `text[: start + k]`, for every k up to the end of `text`."""
    rows: dict[int, torch.Tensor] = {}
    execute = engine.runner.execute

    def recording(inputs):  # type: ignore[no-untyped-def]
        logits = execute(inputs)
        for seq, row in zip(inputs.sampling_seqs, logits, strict=True):
            rows[len(seq.token_ids)] = row.float().clone()
        return logits

    engine.runner.execute = recording  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        for wave in range(start, len(text), BLOCK):
            for n in range(wave, min(wave + BLOCK, len(text))):
                engine.add_request(str(n), text[:n], params)
            while engine.has_unfinished():
                engine.step()
    finally:
        del engine.runner.execute
    return torch.stack([rows[n] for n in range(start, len(text))])


def compare(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {
        "positions": int(ref.shape[0]),
        "top1_agreement": round(float((ref.argmax(1) == got.argmax(1)).float().mean()), 4),
        "max_abs_logit_error": round(float((ref - got).abs().max()), 3),
        "logit_scale": round(float(ref.abs().max()), 3),
        "next_token_hits": round(float((got.argmax(1) == targets).float().mean()), 4),
        "float32_next_token_hits": round(float((ref.argmax(1) == targets).float().mean()), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=336, help="tokens of text read")
    ap.add_argument("--start", type=int, default=16, help="first context length compared")
    ap.add_argument("--variant", action="append", default=[], help="QUANT/KV, e.g. w8a8/bfloat16")
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    common = {"kv_cache_memory": "256MiB", "block_size": BLOCK, "max_num_seqs": BLOCK}
    reference = LLMEngine.from_settings(
        path,
        EngineSettings(quantization="none", dtype="float32", kv_cache_dtype="float32", **common),
    )
    text = reference.tokenizer.encode(TEXT.read_text())[: args.tokens]
    targets = torch.tensor(text[args.start :])  # row k predicts text[start + k]
    ref = next_token_logits(reference, text, args.start)
    del reference
    variants: dict[str, EngineSettings] = {"default": EngineSettings(**common)}
    for v in args.variant:
        quant, kv = v.split("/")
        variants[v] = EngineSettings(quantization=quant, kv_cache_dtype=kv, **common)  # type: ignore[arg-type]
    for name, settings in variants.items():
        engine = LLMEngine.from_settings(path, settings)
        got = next_token_logits(engine, text, args.start)
        row = {"variant": name, "numerics": engine.numerics and engine.numerics.reason}
        print(json.dumps({**row, **compare(ref, got, targets)}), flush=True)
        del engine


if __name__ == "__main__":
    main()
