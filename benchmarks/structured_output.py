"""Structured outputs: what a grammar costs the engine, and what compiling one costs a request.

1. Throughput: a batch of N requests decoded together, once with no grammar and once with half
   of them carrying a json_schema, in the same process and interleaved (A B A B …), reported as
   output tokens/s and their ratio. Every row decodes exactly `--max-tokens` tokens (EOS
   ignored; the schema rows' schema, an array of at least 50 objects, cannot complete sooner),
   so both runs do the same model work and the difference is the masks.
2. Compile time per schema (the 20 test schemas, SmolLM2's 49,152-token vocabulary): cold (a
   fresh compiler; the one-off tokenizer view is timed apart) and cached.
3. `--compare-libraries`: llguidance against xgrammar (install it first: `pip install
   xgrammar`; it is not a dependency): compile cold/cached and per-step mask time at batch 1
   and 32 along a valid JSON document of each schema.

    python benchmarks/structured_output.py                       # N=32, 64 tokens each
    python benchmarks/structured_output.py --batch 16 --rounds 3
    python benchmarks/structured_output.py --compare-libraries
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modelyard.config import EngineSettings
from modelyard.engine import sampler as sampler_module
from modelyard.engine.grammar import GrammarCompiler
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.models.loader import to_hf_folder
from modelyard.engine.sampling_params import SamplingParams
from modelyard.engine.structured import StructuredKind, StructuredOutput
from tests.structured_schemas import SCHEMAS

# Rows with this schema cannot finish before max_tokens: they mask every step of the run.
LONG_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
    },
    "minItems": 50,
}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}"


MASK_SECONDS = [0.0]


def _timed_masks() -> None:
    """Count the time the sampler spends in grammar masks (fill, unpack, apply)."""
    original = sampler_module.apply_grammar_masks

    def timed(logits: torch.Tensor, seqs: list[Any]) -> torch.Tensor:
        started = time.perf_counter()
        out = original(logits, seqs)
        MASK_SECONDS[0] += time.perf_counter() - started
        return out

    sampler_module.apply_grammar_masks = timed  # type: ignore[assignment]


def run_batch(
    engine: LLMEngine, prompts: list[list[int]], grammar_rows: int, tokens: int
) -> tuple[float, float]:
    """Output tokens per wall second and per CPU second (this process's threads; steadier when
    other jobs share the machine) of one batch whose first `grammar_rows` rows carry the schema."""
    structured = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(LONG_SCHEMA))
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_tokens=tokens,
            temperature=1.0,
            seed=i,
            ignore_eos=True,
            structured=structured if i < grammar_rows else None,
        )
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    started, cpu_started = time.perf_counter(), time.process_time()
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            produced += sum(len(d.token_ids) for d in out.deltas)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return produced / wall, produced / cpu


def throughput(engine: LLMEngine, batch: int, tokens: int, rounds: int) -> dict[str, Any]:
    tok = engine.tokenizer
    names = list(SCHEMAS)
    prompts = [
        tok.encode_chat([{"role": "user", "content": SCHEMAS[names[i % len(names)]][0]}])
        for i in range(batch)
    ]
    run_batch(engine, prompts[:2], 1, 8)  # warm up: kernels, the grammar's tokenizer view
    free, mixed, mask_share = [], [], []
    for _ in range(rounds):
        free.append(run_batch(engine, prompts, 0, tokens))
        MASK_SECONDS[0] = 0.0
        started = time.perf_counter()
        mixed.append(run_batch(engine, prompts, batch // 2, tokens))
        mask_share.append(MASK_SECONDS[0] / (time.perf_counter() - started))
    ratios = [m[0] / f[0] for m, f in zip(mixed, free, strict=True)]
    cpu_ratios = [m[1] / f[1] for m, f in zip(mixed, free, strict=True)]
    return {
        "batch": batch,
        "tokens_per_row": tokens,
        "free_tok_s (wall)": [round(x[0], 1) for x in free],
        "half_schema_tok_s (wall)": [round(x[0], 1) for x in mixed],
        "ratio_median (wall)": round(statistics.median(ratios), 3),
        "ratios (wall)": [round(r, 3) for r in ratios],
        "free_tok_per_cpu_s": [round(x[1], 1) for x in free],
        "half_schema_tok_per_cpu_s": [round(x[1], 1) for x in mixed],
        "ratio_median (CPU time)": round(statistics.median(cpu_ratios), 3),
        "ratios (CPU time)": [round(r, 3) for r in cpu_ratios],
        "mask_share_of_wall (half_schema)": [f"{x:.1%}" for x in mask_share],
    }


def compile_times(engine: LLMEngine) -> dict[str, Any]:
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size)
    started = time.perf_counter()
    _ = compiler.ll_tokenizer, compiler.closers  # built once per model, on first use
    tokenizer_s = time.perf_counter() - started
    cold, cached = [], []
    for _, schema in SCHEMAS.values():
        structured = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))
        t0 = time.perf_counter()
        compiler.compile(structured)
        t1 = time.perf_counter()
        compiler.compile(structured)
        t2 = time.perf_counter()
        cold.append(t1 - t0)
        cached.append(t2 - t1)
    return {
        "vocabulary views_ms (once per model)": round(tokenizer_s * 1000, 1),
        "cold_ms p50/max": [round(statistics.median(cold) * 1000, 3), round(max(cold) * 1000, 3)],
        "cached_ms p50/max": [
            round(statistics.median(cached) * 1000, 4),
            round(max(cached) * 1000, 4),
        ],
    }


def compare_libraries(folder: Path, vocab: int, eos: list[int]) -> list[tuple[str, str]]:
    """llguidance vs xgrammar on the same schemas, tokenizer and documents."""
    import llguidance
    from tokenizers import Tokenizer as HFTokenizer

    from modelyard.engine.grammar import JSON_OPTIONS, bound_numbers
    from modelyard.engine.grammar_mask import _parallel_executor

    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return [("xgrammar", "not installed: pip install xgrammar")]
    text = (folder / "tokenizer.json").read_text()
    hf = HFTokenizer.from_str(text)
    docs = {
        "person": {"name": "Ada Lovelace", "age": 36},
        "order": {"order_id": 7, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-9", "qty": 1}]},
        "nested_address": {"company": "Acme", "address": {"street": "1 Main St", "zip": "12345"}},
        "price": {"product": "lamp", "price": 19.5, "currency": "EUR"},
        "refs": {"a": {"x": 1, "y": 2}, "b": {"x": -3, "y": 4}},
    }
    schemas = {k: json.dumps(bound_numbers(SCHEMAS[k][1])) for k in docs}
    rows: list[tuple[str, str]] = []

    def timed(fn: Any) -> tuple[Any, float]:
        t = time.perf_counter()
        value = fn()
        return value, (time.perf_counter() - t) * 1000

    # llguidance
    lt, ms = timed(lambda: llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos))
    rows.append(("llguidance tokenizer view", f"{ms:.0f} ms"))
    templates, cold, cached = {}, [], []
    for k, s in schemas.items():
        g = llguidance.LLMatcher.grammar_from_json_schema(s, defaults=JSON_OPTIONS)
        templates[k], ms = timed(lambda g=g: llguidance.LLMatcher(lt, g, log_level=0))
        cold.append(ms)
        cached.append(timed(templates[k].deep_copy)[1])
    rows.append(
        ("llguidance compile cold (p50/max)", f"{statistics.median(cold):.2f} / {max(cold):.2f} ms")
    )
    rows.append(("llguidance cached (copy)", f"{statistics.median(cached) * 1000:.0f} µs"))
    words = (vocab + 31) // 32
    for batch in (1, 32):
        times = []
        for k, doc in docs.items():
            matchers = [templates[k].deep_copy() for _ in range(batch)]
            mask = torch.empty((batch, words), dtype=torch.int32)
            for token in hf.encode(json.dumps(doc), add_special_tokens=False).ids:
                t = time.perf_counter()
                if batch == 1:
                    matchers[0].unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
                else:
                    _parallel_executor().unsafe_compute_mask_ptr(
                        [(m, i) for i, m in enumerate(matchers)], mask.data_ptr(), words * 4, batch
                    )
                times.append(time.perf_counter() - t)
                for m in matchers:
                    assert m.consume_token(token), m.get_error()
        rows.append(
            (f"llguidance mask, batch {batch} (mean)", f"{statistics.mean(times) * 1000:.3f} ms")
        )

    # xgrammar
    def xgr_setup() -> Any:
        fast = PreTrainedTokenizerFast(tokenizer_object=hf)
        info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab, stop_token_ids=eos)
        return xgr.GrammarCompiler(info, cache_enabled=True)

    compiler, ms = timed(xgr_setup)
    rows.append(("xgrammar tokenizer view", f"{ms:.0f} ms"))
    compiled, cold, cached = {}, [], []
    for k, s in schemas.items():

        def build(s: str = s) -> Any:
            return compiler.compile_json_schema(s, any_whitespace=False, separators=(", ", ": "))

        compiled[k], ms = timed(build)
        cold.append(ms)
        cached.append(timed(build)[1])
    rows.append(
        ("xgrammar compile cold (p50/max)", f"{statistics.median(cold):.2f} / {max(cold):.2f} ms")
    )
    rows.append(("xgrammar cached", f"{statistics.median(cached) * 1000:.0f} µs"))
    batcher = xgr.BatchGrammarMatcher()
    for batch in (1, 32):
        times = []
        for k, doc in docs.items():
            matchers = [xgr.GrammarMatcher(compiled[k]) for _ in range(batch)]
            mask = xgr.allocate_token_bitmask(batch, vocab)
            for token in hf.encode(json.dumps(doc), add_special_tokens=False).ids:
                t = time.perf_counter()
                if batch == 1:
                    matchers[0].fill_next_token_bitmask(mask, 0)
                else:
                    batcher.batch_fill_next_token_bitmask(matchers, mask)
                times.append(time.perf_counter() - t)
                for m in matchers:
                    assert m.accept_token(token)
        rows.append(
            (f"xgrammar mask, batch {batch} (mean)", f"{statistics.mean(times) * 1000:.3f} ms")
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compare-libraries", action="store_true")
    args = parser.parse_args()

    cache = Path(os.environ.get("MODELYARD_CACHE_DIR", Path.home() / ".cache" / "modelyard"))
    folder = to_hf_folder("smollm2", cache)
    settings = EngineSettings(
        dtype=args.dtype, kv_cache_memory=512 * 2**20, max_num_seqs=max(64, args.batch)
    )
    engine = LLMEngine.from_settings(folder, settings)
    _timed_masks()
    print(f"machine: {machine()}; model SmolLM2-135M, dtype {args.dtype}")
    print("\n## Grammar compile time (20 schemas)")
    for key, value in compile_times(engine).items():
        print(f"  {key:36s} {value}")
    print(f"\n## Throughput, batch of {args.batch}, half with a json_schema vs none")
    for key, value in throughput(engine, args.batch, args.max_tokens, args.rounds).items():
        print(f"  {key:36s} {value}")
    if args.compare_libraries:
        print("\n## llguidance vs xgrammar (SmolLM2 tokenizer)")
        eos = sorted(engine.tokenizer.eos_token_ids)
        for key, value in compare_libraries(folder, engine.model_config.vocab_size, eos):
            print(f"  {key:36s} {value}")
    engine.close()


if __name__ == "__main__":
    main()
