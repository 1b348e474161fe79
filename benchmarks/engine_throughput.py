"""Engine throughput vs transformers static batching, and prefix-cache TTFT, on one machine.

Workload: requests with varied prompt lengths and long-tailed output lengths (log-normal, as
chat traffic has), served by 32 closed-loop clients (each sends its next request when the last
one finished). The same requests run through

  * modelyard's engine: continuous batching, paged KV cache (max_num_seqs = concurrency), and
  * transformers `generate`: static batches of the same size, left-padded, each batch running
    until its longest request is done (a streaming client gets its answer at its own length).

Both decode greedily with EOS ignored, so every request produces exactly its target length.
Useful output tokens/s, TTFT and inter-token latency p50/p99 are reported side by side, then
TTFT of a request whose 1,000-token prefix is in the prefix cache against a cold one.

    python benchmarks/engine_throughput.py                 # float32, 96 requests
    python benchmarks/engine_throughput.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modelyard.config import EngineSettings
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.models.loader import to_hf_folder
from modelyard.engine.sampling_params import SamplingParams


@dataclass
class Request:
    prompt: list[int]
    output_len: int


@dataclass
class RunResult:
    name: str
    wall_s: float
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "wall_s": round(self.wall_s, 2),
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.tokens_per_s, 1),
            "ttft_p50_ms": round(pct(self.ttft_s, 50) * 1000, 1),
            "ttft_p99_ms": round(pct(self.ttft_s, 99) * 1000, 1),
            "itl_p50_ms": round(pct(self.itl_s, 50) * 1000, 1),
            "itl_p99_ms": round(pct(self.itl_s, 99) * 1000, 1),
        }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def make_workload(
    n: int, seed: int, vocab_lo: int, vocab_hi: int, max_prompt: int, max_output: int
) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt_len = int(min(max_prompt, max(16, rng.lognormvariate(math.log(128), 0.7))))
        output_len = int(min(max_output, max(8, rng.lognormvariate(math.log(64), 1.0))))
        prompt = [rng.randrange(vocab_lo, vocab_hi) for _ in range(prompt_len)]
        requests.append(Request(prompt, output_len))
    return requests


def run_engine(engine: LLMEngine, requests: list[Request], concurrency: int) -> RunResult:
    pending = deque(enumerate(requests))
    submitted: dict[str, float] = {}
    last_token: dict[str, float] = {}
    result = RunResult("modelyard engine (continuous batching)", 0.0, 0)

    def submit() -> None:
        i, req = pending.popleft()
        rid = str(i)
        params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(rid, req.prompt, params)
        submitted[rid] = time.perf_counter()

    start = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        submit()
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            n = sum(len(d.token_ids) for d in out.deltas)
            if not n:
                continue
            result.output_tokens += n
            if out.request_id not in last_token:
                result.ttft_s.append(now - submitted[out.request_id])
            else:
                result.itl_s.append((now - last_token[out.request_id]) / n)
            last_token[out.request_id] = now
            if out.finished and pending:
                submit()
    result.wall_s = time.perf_counter() - start
    return result


def run_transformers_static(
    model: Any, pad_id: int, requests: list[Request], batch_size: int
) -> RunResult:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model.generation_config.eos_token_id = None
    result = RunResult("transformers generate (static batches)", 0.0, 0)
    start = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        clock = StepClock()
        batch_start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(r.output_len for r in batch),
                do_sample=False,
                pad_token_id=pad_id,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        for r in batch:
            times = clock.times[: r.output_len]
            result.ttft_s.append(times[0] - batch_start)
            result.itl_s.extend(b - a for a, b in itertools.pairwise(times))
            result.output_tokens += r.output_len
    result.wall_s = time.perf_counter() - start
    return result


def prefix_cache_ttft(engine: LLMEngine, prefix_len: int, trials: int, seed: int) -> dict:
    """Median TTFT of a request whose long prefix is cached vs one whose prefix is new."""
    rng = random.Random(seed)

    def ttft(prompt: list[int], rid: str) -> float:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t0

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    shared = tokens(prefix_len)
    ttft(shared + tokens(24), "prime")
    cold, warm, cached = [], [], []
    for t in range(trials):
        cold.append(ttft(tokens(prefix_len) + tokens(24), f"cold{t}"))
        hits_before = engine.kv.prefix_hits
        warm.append(ttft(shared + tokens(24), f"warm{t}"))
        cached.append(engine.kv.prefix_hits - hits_before)
    return {
        "prefix_tokens": prefix_len,
        "cold_ttft_ms": round(statistics.median(cold) * 1000, 1),
        "cached_ttft_ms": round(statistics.median(warm) * 1000, 1),
        "cached_tokens_per_request": int(statistics.median(cached)),
        "speedup": round(statistics.median(cold) / statistics.median(warm), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    settings = EngineSettings(
        dtype=args.dtype,
        kv_cache_memory="4GiB",
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=512,
        max_tokens_cap=max(4096, args.max_output),
    )
    folder = to_hf_folder(args.model, settings.cache_dir)
    engine = LLMEngine.from_settings(folder, settings)
    requests = make_workload(
        args.num_requests,
        args.seed,
        100,
        min(40000, engine.model_config.vocab_size),
        args.max_prompt,
        args.max_output,
    )
    print(
        f"{len(requests)} requests, prompt tokens p50 "
        f"{statistics.median(len(r.prompt) for r in requests):.0f}, output tokens p50 "
        f"{statistics.median(r.output_len for r in requests):.0f} / max "
        f"{max(r.output_len for r in requests)}, concurrency {args.concurrency}, {args.dtype}"
    )
    run_engine(engine, requests[: args.concurrency // 4], args.concurrency)  # warm-up
    results = [run_engine(engine, requests, args.concurrency)]
    print(json.dumps(results[0].summary()))
    if not args.skip_baseline:
        from transformers import AutoModelForCausalLM

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
        pad = engine.tokenizer.pad_token_id or 0
        run_transformers_static(hf, pad, requests[:2], 2)  # warm-up
        results.append(run_transformers_static(hf, pad, requests, args.concurrency))
        print(json.dumps(results[1].summary()))
        del hf

    fresh = LLMEngine.from_settings(folder, settings)
    prefix = prefix_cache_ttft(fresh, args.prefix_len, trials=5, seed=args.seed)

    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
        "model": args.model,
        "dtype": args.dtype,
        "workload": {
            "requests": len(requests),
            "concurrency": args.concurrency,
            "prompt_tokens_p50": statistics.median(len(r.prompt) for r in requests),
            "output_tokens_p50": statistics.median(r.output_len for r in requests),
            "output_tokens_max": max(r.output_len for r in requests),
            "output_tokens_total": sum(r.output_len for r in requests),
        },
        "runs": [r.summary() for r in results],
        "prefix_cache": prefix,
    }
    if len(results) == 2:
        report["throughput_ratio"] = round(results[0].tokens_per_s / results[1].tokens_per_s, 2)

    print()
    header = f"{'run':<42}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
    print(header)
    for r in report["runs"]:
        print(
            f"{r['name']:<42}{r['output_tokens_per_s']:>8}{r['ttft_p50_ms']:>9}ms"
            f"{r['ttft_p99_ms']:>8}ms{r['itl_p50_ms']:>7}ms{r['itl_p99_ms']:>7}ms"
        )
    if "throughput_ratio" in report:
        print(f"throughput ratio engine / transformers static: {report['throughput_ratio']}x")
    print(
        f"prefix cache: {prefix['prefix_tokens']}-token shared prefix, TTFT cold "
        f"{prefix['cold_ttft_ms']} ms vs cached {prefix['cached_ttft_ms']} ms "
        f"({prefix['speedup']}x)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
