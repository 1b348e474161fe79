"""Speculative decoding (`speculative`: ngram, and draft with a draft model) vs plain decoding.

One engine per mode on SmolLM2-135M-Instruct (the GGUF the tests use, converted), concurrency 1,
greedy. With `--draft-layers N` a third mode drafts with a truncated copy of the same model: its
embedding, first N decoder layers, final norm and head (the same tokenizer, N/30 of the layers'
compute but the whole 28M-parameter vocabulary projection); `--draft PATH` names another draft
model instead. Each mode summarises documents whose summary copies spans of the input (a
"rewrite the notes" prompt) and answers a prompt with no such overlap; rounds alternate between
the modes so drift in a shared machine's load hits both. Prints decode tokens/s per round, their
medians, the acceptance rate and tokens per verifying step, and checks that the outputs match.

    python benchmarks/spec_decode.py --rounds 3 --max-tokens 128
    python benchmarks/spec_decode.py --rounds 2 --max-tokens 96 --draft-layers 4
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


def truncated_copy(folder: Path, layers: int, out: Path) -> Path:
    """`folder`'s model cut to its first `layers` decoder layers (a draft, same vocabulary)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    kept = {}
    for f in folder.glob("*.safetensors"):
        for name, t in load_file(str(f)).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            kept[name] = t
    save_file(kept, str(out / "model.safetensors"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--draft-layers", type=int, default=0, help="also: a truncated-layer draft")
    ap.add_argument("--draft", default=None, help="also: this draft model (speculative=draft)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="modelyard-bench-"))
    folder = to_hf_folder("smollm2", tmp)
    draft = args.draft
    if args.draft_layers:
        draft = str(truncated_copy(folder, args.draft_layers, tmp / "draft"))
    modes = ["off", "ngram"] + (["draft"] if draft else [])
    engines = {
        mode: LLMEngine.from_settings(
            folder,
            EngineSettings(
                speculative=mode,
                speculative_model=draft if mode == "draft" else None,
                num_speculative_tokens=args.k,
                enable_prefix_caching=False,
            ),
        )
        for mode in modes
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
            order = modes[r % len(modes) :] + modes[: r % len(modes)]  # each mode first in turn
            for mode in order:
                engine = engines[mode]
                before = (engine.spec_stats.draft_tokens, engine.spec_stats.accepted_tokens)
                temperature = 0.8 if name.endswith("@0.8") else 0.0
                rate, tokens = time_request(engine, prompt, args.max_tokens, temperature)
                rates.setdefault((name, mode), []).append(rate)
                outputs[(name, mode)] = tokens
                drafted = engine.spec_stats.draft_tokens - before[0]
                accepted = engine.spec_stats.accepted_tokens - before[1]
                extra = f" accepted {accepted}/{drafted}" if mode != "off" else ""
                print(
                    f"round {r} {name:8s} {mode:5s} {len(tokens)} tokens {rate:6.1f} tok/s{extra}"
                )
    print(f"load after {os.getloadavg()}")
    for name in prompts:
        print(f"{name}: {tok.decode(outputs[(name, 'ngram')])[:160]!r}")
    for name in prompts:
        off = statistics.median(rates[(name, "off")])
        line = f"{name:8s} off {off:6.1f} tok/s"
        for mode in modes[1:]:
            on = statistics.median(rates[(name, mode)])
            same = outputs[(name, "off")] == outputs[(name, mode)]
            line += f"  {mode} {on:6.1f} tok/s x{on / off:.2f} same={same}"
        print(line)
    print("(same=False is expected for the sampled row: its draws differ, not its distribution)")
    for mode in modes[1:]:
        s = engines[mode].spec_stats
        print(
            f"{mode}: overall acceptance {s.accepted_tokens / max(s.draft_tokens, 1):.2f}, "
            f"tokens per verifying step {s.emitted_tokens / max(s.spec_steps, 1):.2f}"
        )


if __name__ == "__main__":
    main()
