"""Cache-aware routing vs the text-hash affinity it replaced vs least-loaded: prefix-cache hit
rate and TTFT, same workload, same run, rounds alternating.

Starts `modelyard serve` once per routing mode and round, deploys SmolLM2 (its bundled GGUF) with
two replicas, each with a small KV cache (`--kv-cache`), and creates `--tenants` tenants, each
with its own key and its own system prompt of `--prefix-words` words (an app's instructions).
Requests arrive as a Poisson process (`--rate`); each is a random tenant's system prompt plus a
question of its own, streamed, `--max-tokens` greedy tokens. The arrivals, tenants and questions
are the same in every mode and round (seeded). Modes:

- cache-aware: this tree's routing (`MODELYARD_PREFIX_AWARE_ROUTING=true`): each replica reports
  which prefix keys its KV cache holds, the gateway sends a request to the longest cached
  prefix within bounded load (`MODELYARD_CACHE_ROUTING_LOAD_FACTOR`, `--load-factor`);
- text-hash: the previous routing, run from another source tree (`--text-hash-src`, e.g. a
  checkout of the commit before cache-aware routing): a hash of the leading system prompt's
  text placed by rendezvous hashing, load factor 1.25; left out without that option;
- least-loaded: this tree with `MODELYARD_PREFIX_AWARE_ROUTING=false`.

When the caches cannot hold every prompt (the default sizes), routing decides between
recomputing a system prompt and reading it from the cache. Reported per mode (all rounds
pooled): the share of prompt tokens served from the prefix cache (the usage's `cached_tokens`),
TTFT p50/p90/p99, end-to-end p50, failures; then each mode's TTFT p50 and p99 against
least-loaded's, per round and pooled.

    python benchmarks/prefix_routing.py [--tenants 16] [--requests 80] [--rate 0.5] \
        [--rounds 2] [--text-hash-src /path/to/old/src]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import Outcome, _bundled_gguf, _words, one_request, pct

from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    wait_status,
)


def workload(args: argparse.Namespace) -> list[tuple[float, int, str]]:
    """(arrival s, tenant index, question) for every request, seeded."""
    rng = random.Random(args.seed)
    at, out = 0.0, []
    for i in range(args.requests):
        out.append((at, rng.randrange(args.tenants), f"Question {i}: {_words(rng, 24)}"))
        at += rng.expovariate(args.rate)
    return out


async def drive(
    url: str, keys: list[str], systems: list[str], args: argparse.Namespace
) -> list[Outcome]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def send(at: float, tenant: int, question: str) -> Outcome:
            await asyncio.sleep(at)
            body = {
                "model": "smol",
                "messages": [
                    {"role": "system", "content": systems[tenant]},
                    {"role": "user", "content": question},
                ],
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            headers = {"Authorization": f"Bearer {keys[tenant]}"}
            return await one_request(session, f"{url}/v1/chat/completions", headers, body)

        return list(await asyncio.gather(*(send(*r) for r in workload(args))))


SRC = Path(__file__).resolve().parents[1] / "src"


def run_mode(mode: str, args: argparse.Namespace, work: Path) -> list[Outcome]:
    engine = {"kv_cache_memory": args.kv_cache, "num_threads": 1, "dtype": "float32"}
    env = {
        "MODELYARD_PREFIX_AWARE_ROUTING": str(mode != "least-loaded").lower(),
        "MODELYARD_CACHE_ROUTING_LOAD_FACTOR": str(args.load_factor),
        "MODELYARD_WORKER_ENGINE": json.dumps(engine),
        "PYTHONPATH": str(args.text_hash_src if mode == "text-hash" else SRC),
    }
    with contextlib.ExitStack() as stack:
        serve = PlatformProcess(work, env).start(timeout=300)
        stack.callback(serve.stop)
        admin = serve.api()
        hardware = {"min_replicas": 2, "max_replicas": 2}
        gguf = str(_bundled_gguf())
        endpoint = deploy(admin, "smol", gguf, False, public=True, hardware=hardware)
        wait_status(admin, endpoint, "ready", timeout=900)  # a shared machine loads slowly
        rng = random.Random(args.seed + 1)
        systems = [
            f"You are the assistant of company {k}. " + _words(rng, args.prefix_words)
            for k in range(args.tenants)
        ]
        keys = []
        for k in range(args.tenants):
            tenant = create_tenant(admin, f"tenant-{k}")
            keys.append(create_key(admin, tenant, rpm_limit=10**6, tpm_limit=10**9)["key"])
        print(f"{mode}: 2 replicas ready, {args.tenants} tenants; sending", flush=True)
        return asyncio.run(drive(serve.url, keys, systems, args))


def summary(mode: str, outcomes: list[Outcome]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft_s for o in ok]
    prompt = sum(o.prompt_tokens for o in ok)
    return {
        "mode": mode,
        "requests": len(outcomes),
        "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:3],
        "prefix_cache_hit_rate": round(sum(o.cached_tokens for o in ok) / max(1, prompt), 3),
        "prompt_tokens_mean": round(prompt / max(1, len(ok)), 1),
        **{f"ttft_p{q}_ms": round(pct(ttft, q) * 1e3, 1) for q in (50, 90, 99)},
        "e2e_p50_ms": round(pct([o.e2e_s for o in ok], 50) * 1e3, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--prefix-words", type=int, default=200)
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--rate", type=float, default=0.5, help="requests/s (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-cache", default="160MiB", help="each replica's KV cache")
    ap.add_argument("--load-factor", type=float, default=1.0, help="cache-aware routing's")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--text-hash-src", type=Path, help="a source tree with the text-hash routing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(
        f"machine {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs; "
        f"{vars(args)}",
        flush=True,
    )
    modes = ["cache-aware", "least-loaded"] + (["text-hash"] if args.text_hash_src else [])
    work = Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    pooled: dict[str, list[Outcome]] = {m: [] for m in modes}
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]  # who goes first rotates
        this: dict[str, dict[str, Any]] = {}
        for mode in order:
            outcomes = run_mode(mode, args, work / f"{mode}-{r}")
            pooled[mode] += outcomes
            this[mode] = summary(mode, outcomes)
            print(json.dumps({"round": r, **this[mode]}), flush=True)
        rounds.append(this)
    rows = [summary(m, pooled[m]) for m in modes]
    print("\npooled over rounds:")
    for row in rows:
        print(json.dumps(row), flush=True)
    for mode in modes:
        if mode == "least-loaded":
            continue
        per_round = [
            f"{x[mode]['ttft_p99_ms'] / x['least-loaded']['ttft_p99_ms']:.2f}" for x in rounds
        ]
        row, base = rows[modes.index(mode)], rows[modes.index("least-loaded")]
        print(
            f"{mode}: hit rate {row['prefix_cache_hit_rate']:.1%} "
            f"(least-loaded {base['prefix_cache_hit_rate']:.1%}); TTFT p50 "
            f"{row['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x, p99 "
            f"{row['ttft_p99_ms'] / base['ttft_p99_ms']:.2f}x least-loaded's "
            f"(p99 per round: {', '.join(per_round)})"
        )
    if args.json:
        args.json.write_text(json.dumps({"pooled": rows, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
