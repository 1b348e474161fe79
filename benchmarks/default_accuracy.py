"""Accuracy of the engine's default numerics on a quantized GGUF against float32, teacher-forced.

The model file (default: SmolLM2's bundled Q4_1 GGUF) is loaded twice: as float32 (the GGUF
dequantized, `quantization: none`, float32 KV cache) and with no setting (what
`engine/defaults.py` chooses on this CPU), plus any `--variant QUANT/KV` given. Both read the
same real text (this repository's README, its first `--tokens` tokens): at every position each
predicts the next token from the text so far (teacher forcing: one early difference does not
derail the rest). Reported per variant: top-1 agreement with float32, max |logit error| and the
largest |logit| (its scale), and how often each predicts the text's own next token.

With `--llama-cpp`, llama.cpp's own numerics on the same file join in (`llama_cpp_probs.py`):
llama-server's top-K next-token probabilities at the same positions, from the same token ids
(its tokenizer is checked against ours first). Each variant, float32 included, then also reports
top-1 agreement with llama.cpp's top-1 and the max / mean |probability difference| over
llama.cpp's top K tokens (ours: the softmax of our logits); a `llama.cpp` line gives its own
top-1 agreement with float32.

Contexts run in waves of `block_size` requests that share the cached prefix before them, so
each request computes at most two blocks of new tokens.

    python benchmarks/default_accuracy.py
    python benchmarks/default_accuracy.py --tokens 300 --variant w8a8/bfloat16
    nice -n 15 python benchmarks/default_accuracy.py --llama-cpp --variant gguf/bfloat16
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from llama_cpp_probs import against_llama, check_tokenizer, llama_row, llama_server, top_probs

from modelyard.config import EngineSettings
from modelyard.control.backends.local import free_port
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.models.bundled import resolve_model_path
from modelyard.engine.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = 16
# A second tokenizer check beside the README (a warning only: the README's compared prefix is
# what must match): spaces, digits, accents, CJK, an emoji, code, special tokens' text.
TOKENIZER_SAMPLE = "Hello  world!\n\t12345 café naïve — 日本語 🙂 `x = f(y) ** 2` </s> <|im_end|>"


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
    ap.add_argument("--llama-cpp", action="store_true", help="also against llama-server's probs")
    ap.add_argument("--top-k", type=int, default=20, help="--llama-cpp: llama.cpp's n_probs")
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
    llama = None
    if args.llama_cpp:
        encode = reference.tokenizer.encode
        log = Path(tempfile.gettempdir()) / "default-accuracy-llama-cpp.log"
        with llama_server(path, max(512, args.tokens + 64), free_port(), log) as base:
            check_tokenizer(base, TEXT.read_text(), encode(TEXT.read_text()), args.tokens)
            check_tokenizer(base, TOKENIZER_SAMPLE, encode(TOKENIZER_SAMPLE), 0)  # warns only
            ids, logprobs = top_probs(base, text, args.start, args.top_k)
        llama = (ids, logprobs)
        print(json.dumps(llama_row(ref, ids, logprobs, targets)), flush=True)
        row = {"variant": "float32", "numerics": reference.numerics and reference.numerics.reason}
        print(json.dumps({**row, **against_llama(ref, ids, logprobs)}), flush=True)
    del reference
    variants: dict[str, EngineSettings] = {"default": EngineSettings(**common)}
    for v in args.variant:
        quant, kv = v.split("/")
        variants[v] = EngineSettings(quantization=quant, kv_cache_dtype=kv, **common)  # type: ignore[arg-type]
    for name, settings in variants.items():
        engine = LLMEngine.from_settings(path, settings)
        got = next_token_logits(engine, text, args.start)
        row = {"variant": name, "numerics": engine.numerics and engine.numerics.reason}
        row |= compare(ref, got, targets) | (against_llama(got, *llama) if llama else {})
        print(json.dumps(row), flush=True)
        del engine


if __name__ == "__main__":
    main()
