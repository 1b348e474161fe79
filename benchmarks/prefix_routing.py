"""Prefix-aware routing vs least-loaded: prefix-cache hit rate and TTFT, same workload, same run.

Starts `modelyard serve` once per routing mode (`prefix_aware_routing` on, then off), deploys
SmolLM2 (its bundled GGUF) with two replicas, each with a small KV cache (`--kv-cache`), and
creates `--tenants` tenants, each with its own key and its own system prompt of
`--prefix-words` words (an app's instructions). Requests arrive as a Poisson process
(`--rate`); each is a random tenant's system prompt plus a question of its own, streamed,
`--max-tokens` greedy tokens. The arrivals, tenants and questions are the same in both modes
(seeded).

With least-loaded routing every replica sees every tenant's prompt, so its cache must hold all
of them; prefix-aware routing sends each tenant to "its" replica (bounded load), so each cache
holds half. When the caches cannot hold every prompt (the default sizes), that is the
difference between recomputing the system prompt and reading it from the cache.

Reported per mode: the share of prompt tokens served from the prefix cache (the usage's
`cached_tokens`), TTFT p50/p90/p99, end-to-end p50, failures; then the TTFT p50 gain.

    python benchmarks/prefix_routing.py [--tenants 16] [--requests 80] [--rate 0.7]
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

from tests.platform_harness import PlatformProcess, create_key, create_tenant, deploy


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


def run_mode(prefix_aware: bool, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    mode = "prefix-aware" if prefix_aware else "least-loaded"
    engine = {"kv_cache_memory": args.kv_cache, "num_threads": 1, "dtype": "float32"}
    env = {
        "MODELYARD_PREFIX_AWARE_ROUTING": str(prefix_aware).lower(),
        "MODELYARD_WORKER_ENGINE": json.dumps(engine),
    }
    with contextlib.ExitStack() as stack:
        serve = PlatformProcess(work / mode, env).start(timeout=300)
        stack.callback(serve.stop)
        admin = serve.api()
        hardware = {"min_replicas": 2, "max_replicas": 2}
        deploy(admin, "smol", str(_bundled_gguf()), public=True, hardware=hardware)
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
        outcomes = asyncio.run(drive(serve.url, keys, systems, args))
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
    ap.add_argument("--rate", type=float, default=0.7, help="requests/s (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-cache", default="96MiB", help="each replica's KV cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(
        f"machine {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs; "
        f"{vars(args)}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    rows = [run_mode(aware, args, work) for aware in (True, False)]
    for row in rows:
        print(json.dumps(row), flush=True)
    aware, least = rows
    gain = least["ttft_p50_ms"] / aware["ttft_p50_ms"] if aware["ttft_p50_ms"] else float("nan")
    print(
        f"\nprefix cache hit rate: prefix-aware {aware['prefix_cache_hit_rate']:.1%}, "
        f"least-loaded {least['prefix_cache_hit_rate']:.1%}; TTFT p50 "
        f"{aware['ttft_p50_ms']:.0f} vs {least['ttft_p50_ms']:.0f} ms ({gain:.2f}x lower)"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
