"""Batch throughput, and what a running batch does to real-time latency, in one run.

Starts `modelyard serve` with its default model (SmolLM2-135M-Instruct), then:

  1. idle: real-time streaming chat requests one after another; TTFT = time to the first
     content token through the gateway;
  2. submits a large batch (the OpenAI Files + Batches APIs) and, while it runs, sends the
     same real-time requests again;
  3. waits for the batch: items/s and completion tokens/s from in_progress to completed.

Target: with the batch running, real-time p50 TTFT <= 1.5x idle.

    python benchmarks/batch.py [--items 400] [--probes 30] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.platform_harness import PlatformProcess

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What is the opposite of hot?",
]


def ttft_probe(client: Any, i: int) -> float:
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    assert first is not None
    return first


def probes(client: Any, n: int, gap_s: float) -> list[float]:
    out = []
    for i in range(n):
        out.append(ttft_probe(client, i))
        time.sleep(gap_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--items", type=int, default=400)
    ap.add_argument("--probes", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--gap", type=float, default=0.3, help="seconds between real-time probes")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    platform = PlatformProcess(work / "data", default_models=True).start(timeout=600)
    try:
        client = platform.openai()
        probes(client, 3, 0.0)  # warm-up
        idle = probes(client, args.probes, args.gap)

        lines = [
            {
                "custom_id": f"item-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "smollm2",
                    "messages": [
                        {"role": "user", "content": f"Write two sentences about topic {i}."}
                    ],
                    "max_tokens": args.max_tokens,
                    "temperature": 0.7,
                },
            }
            for i in range(args.items)
        ]
        data = "\n".join(json.dumps(x) for x in lines).encode()
        upload = client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while client.batches.retrieve(batch.id).request_counts.completed < 8:
            time.sleep(0.2)
        busy = probes(client, args.probes, args.gap)
        in_flight_when_done = client.batches.retrieve(batch.id).request_counts.completed
        while (b := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            time.sleep(0.5)
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
        seconds = b.completed_at - b.in_progress_at
    finally:
        platform.stop()

    report = {
        "items": args.items,
        "completed": b.request_counts.completed,
        "batch_seconds": seconds,
        "items_per_s": round(b.request_counts.completed / seconds, 2),
        "completion_tokens_per_s": round(tokens / seconds, 1),
        "realtime_ttft_idle_p50_ms": round(statistics.median(idle) * 1000, 1),
        "realtime_ttft_with_batch_p50_ms": round(statistics.median(busy) * 1000, 1),
        "ratio_p50": round(statistics.median(busy) / statistics.median(idle), 2),
        "realtime_ttft_idle_p90_ms": round(sorted(idle)[int(0.9 * len(idle))] * 1000, 1),
        "realtime_ttft_with_batch_p90_ms": round(sorted(busy)[int(0.9 * len(busy))] * 1000, 1),
        "batch_items_done_while_probing": in_flight_when_done,
    }
    print(json.dumps(report, indent=2))
    print(
        f"\nbatch: {report['items_per_s']} items/s, {report['completion_tokens_per_s']} "
        f"completion tokens/s (whole-second timestamps: {seconds} s)\n"
        f"real-time TTFT p50: idle {report['realtime_ttft_idle_p50_ms']} ms, with the batch "
        f"running {report['realtime_ttft_with_batch_p50_ms']} ms ({report['ratio_p50']}x)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
