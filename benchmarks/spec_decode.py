"""Speculative decoding by prompt lookup (`speculative: ngram`) against plain decoding.

One engine per mode on SmolLM2-135M-Instruct (the GGUF the tests use, converted), concurrency 1,
greedy: each mode summarises documents whose summary copies spans of the input (a
"rewrite the notes" prompt) and answers a prompt with no such overlap; rounds alternate between
the modes so drift in a shared machine's load hits both. Prints decode tokens/s per round, their
medians, the acceptance rate and tokens per verifying step, and checks that the outputs match.

    python benchmarks/spec_decode.py --rounds 3 --max-tokens 128
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from modelyard.config import EngineSettings
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.models.loader import to_hf_folder
from modelyard.engine.sampling_params import SamplingParams

DOCUMENT = (
    "Meeting notes, platform team, Tuesday. The deploy pipeline now builds images in four "
    "minutes instead of eleven, because the dependency layer is cached between runs. The "
    "on-call rotation moves to weekly shifts starting next month, and every shift ends with a "
    "written handover. The database migration for the billing service is scheduled for Friday "
    "at 06:00 UTC; it needs a read-only window of twenty minutes. The load balancer health "
    "check will be changed from a TCP probe to an HTTP probe on /healthz. Alice owns the "
    "migration, Bob owns the health check, and Carol writes the handover template."
)
TASKS = {
    "rewrite": "Rewrite these notes as a bulleted list, keeping every sentence's wording:\n\n",
    "summary": "Summarise the document below, quoting its key sentences:\n\n",
    "free": "Write a short poem about the sea. Do not mention this document:\n\n",
}
SAMPLED = "free"  # also run sampled (temperature 0.8, seed 0): drafts are accepted less often


def time_request(
    engine: LLMEngine, prompt: list[int], max_tokens: int, temperature: float = 0.0
) -> tuple[float, list[int]]:
    """Decode tokens/s of one request (first token to last) and its tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
    engine.add_request("bench", prompt, params)
    tokens: list[int] = []
    first = last = 0.0
    while engine.has_unfinished():
        for out in engine.step():
            for d in out.deltas:
                if d.token_ids and not tokens:
                    first = time.perf_counter()
                tokens += d.token_ids
        last = time.perf_counter()
    return (len(tokens) - 1) / (last - first), tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args()
    folder = to_hf_folder("smollm2", Path(tempfile.mkdtemp(prefix="modelyard-bench-")))
    engines = {
        mode: LLMEngine.from_settings(
            folder,
            EngineSettings(
                speculative=mode, num_speculative_tokens=args.k, enable_prefix_caching=False
            ),
        )
        for mode in ("off", "ngram")
    }
    tok = engines["off"].tokenizer
    prompts = {
        name: tok.encode_chat([{"role": "user", "content": task + DOCUMENT}])
        for name, task in TASKS.items()
    }
    prompts[SAMPLED + "@0.8"] = prompts[SAMPLED]
    for engine in engines.values():  # warm-up: first steps build kernels and caches
        time_request(engine, prompts["free"], 16)
    print(f"{platform.processor() or platform.machine()}, load {os.getloadavg()}")
    rates: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list[int]] = {}
    for r in range(args.rounds):
        for name, prompt in prompts.items():
            order = ("off", "ngram") if r % 2 == 0 else ("ngram", "off")
            for mode in order:
                engine = engines[mode]
                before = (engine.spec_stats.draft_tokens, engine.spec_stats.accepted_tokens)
                temperature = 0.8 if name.endswith("@0.8") else 0.0
                rate, tokens = time_request(engine, prompt, args.max_tokens, temperature)
                rates.setdefault((name, mode), []).append(rate)
                outputs[(name, mode)] = tokens
                drafted = engine.spec_stats.draft_tokens - before[0]
                accepted = engine.spec_stats.accepted_tokens - before[1]
                extra = f" accepted {accepted}/{drafted}" if mode == "ngram" else ""
                print(
                    f"round {r} {name:8s} {mode:5s} {len(tokens)} tokens {rate:6.1f} tok/s{extra}"
                )
    print(f"load after {os.getloadavg()}")
    s = engines["ngram"].spec_stats
    for name in prompts:
        print(f"{name}: {tok.decode(outputs[(name, 'ngram')])[:160]!r}")
    for name in prompts:
        off = statistics.median(rates[(name, "off")])
        on = statistics.median(rates[(name, "ngram")])
        same = outputs[(name, "off")] == outputs[(name, "ngram")]
        print(
            f"{name:8s} off {off:6.1f} tok/s  ngram {on:6.1f} tok/s  x{on / off:.2f}  same={same}"
        )
    print("(same=False is expected for the sampled row: its draws differ, not its distribution)")
    print(
        f"overall acceptance {s.accepted_tokens / max(s.draft_tokens, 1):.2f}, "
        f"tokens per verifying step {s.emitted_tokens / max(s.spec_steps, 1):.2f}"
    )


if __name__ == "__main__":
    main()
