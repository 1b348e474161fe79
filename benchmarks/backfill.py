"""Backfill on one real worker: real-time latency with a saturating batch backlog against none,
and the batch tokens/s the backlog gets from the slots real-time traffic leaves idle.

Starts `modelyard serve` with its default model (SmolLM2-135M-Instruct; `--model tiny`: a
tiny random Llama from `tests/tiny_models.py`, for a machine too loaded for SmolLM2), its
engine at `--slots` sequences, the batch runner allowed that many items in flight (so a
backlog can fill every slot), then alternates rounds of `--round-s` seconds:

  none     real-time streaming chat requests arrive open-loop at `--rate` per second;
  backlog  the same arrivals while a batch far larger than the round runs (its items go to the
           replica only while it reports free slots and KV, at the engine's batch priority; the
           engine preempts them for real-time requests). The batch is cancelled at the round's
           end: its finished items' completion tokens over the round are the tokens gained.

Reported per mode over all its rounds: real-time TTFT p50/p99, inter-token p99 (gaps between
streamed content chunks), the backlog/none ratios, and the batch tokens/s gained.

    python benchmarks/backfill.py [--rounds 2] [--round-s 40] [--rate 1.0] [--slots 8]
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.platform_harness import PlatformProcess, deploy
from tests.tiny_models import build_model

MODEL = "smollm2"

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What is the opposite of hot?",
]


def one_request(client: Any, i: int, max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) of one streamed real-time request."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    stamps = [
        time.perf_counter() for chunk in stream if chunk.choices and chunk.choices[0].delta.content
    ]
    assert stamps, "no content streamed"
    return stamps[0] - t0, [b - a for a, b in itertools.pairwise(stamps)]


def realtime_round(client: Any, seconds: float, rate: float, max_tokens: int) -> dict[str, list]:
    """Open-loop arrivals at `rate`/s for `seconds`; every request's TTFT and gaps."""
    ttft: list[float] = []
    gaps: list[float] = []
    failed: list[str] = []
    lock = threading.Lock()
    threads = []

    def run(i: int) -> None:
        try:
            first, between = one_request(client, i, max_tokens)
        except Exception as exc:  # counted, not hidden: the report shows how many failed
            with lock:
                failed.append(repr(exc))
            return
        with lock:
            ttft.append(first)
            gaps.extend(between)

    start = time.perf_counter()
    i = 0
    while (due := start + i / rate) < start + seconds:
        time.sleep(max(0.0, due - time.perf_counter()))
        t = threading.Thread(target=run, args=(i,))
        t.start()
        threads.append(t)
        i += 1
    for t in threads:
        t.join()
    return {"ttft": ttft, "gaps": gaps, "failed": failed}


def start_backlog(client: Any, items: int, max_tokens: int) -> str:
    lines = [
        {
            "custom_id": f"item-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Write about topic {i}."}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i in range(items)
    ]
    data = "\n".join(json.dumps(x) for x in lines).encode()
    upload = client.files.create(file=("backlog.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while client.batches.retrieve(batch.id).status != "in_progress":
        time.sleep(0.1)
    # Saturated: the first items are done, so the runner has filled the slots.
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        time.sleep(0.1)
    return str(batch.id)


def stop_backlog(client: Any, batch_id: str, since: float) -> tuple[int, float]:
    """Cancel; the completion tokens of the items that finished after `since` (unix time), and
    the seconds from `since` to the cancel."""
    cancelled_at = time.time()
    client.batches.cancel(batch_id)
    while (b := client.batches.retrieve(batch_id)).status not in ("cancelled", "completed"):
        time.sleep(0.2)
    done = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    tokens = 0
    for o in done:
        body = o["response"]["body"]
        if body.get("created", 0) >= int(since):
            tokens += body["usage"]["completion_tokens"]
    return tokens, cancelled_at - since


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="pairs of rounds (none, backlog)")
    ap.add_argument("--round-s", type=float, default=40.0)
    ap.add_argument("--rate", type=float, default=1.0, help="real-time requests per second")
    ap.add_argument("--max-tokens", type=int, default=24, help="per real-time request")
    ap.add_argument("--slots", type=int, default=8, help="engine max_num_seqs")
    ap.add_argument("--reserved-slots", type=int, default=0, help="backfill_reserved_slots")
    ap.add_argument("--batch-max-tokens", type=int, default=64)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    global MODEL
    MODEL = args.model

    env = {
        "MODELYARD_WORKER_ENGINE": json.dumps({"max_num_seqs": args.slots}),
        "MODELYARD_BATCH_CONCURRENCY": str(args.slots),
        "MODELYARD_BACKFILL_RESERVED_SLOTS": str(args.reserved_slots),
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
    }
    work = Path(tempfile.mkdtemp(prefix="backfill-bench-"))
    tiny = args.model == "tiny"
    platform = PlatformProcess(work / "data", env, default_models=not tiny).start(timeout=900)
    if tiny:
        deploy(platform.api(), "tiny", str(build_model(work / "tiny", "llama")), public=True)
    modes: dict[str, dict[str, list]] = {
        m: {"ttft": [], "gaps": [], "failed": []} for m in ("none", "backlog")
    }
    gained_tokens, gained_s = 0, 0.0
    try:
        client = platform.openai()
        realtime_round(client, 5, args.rate, args.max_tokens)  # warm-up
        for r in range(args.rounds):
            for mode in ("none", "backlog"):
                batch_id = None
                if mode == "backlog":
                    items = int(args.round_s * args.slots * 2)  # more than the round can do
                    batch_id = start_backlog(client, items, args.batch_max_tokens)
                since = time.time()
                got = realtime_round(client, args.round_s, args.rate, args.max_tokens)
                for k, v in got.items():
                    modes[mode][k].extend(v)
                if batch_id is not None:
                    tokens, seconds = stop_backlog(client, batch_id, since)
                    gained_tokens += tokens
                    gained_s += seconds
                print(f"round {r} {mode}: {len(got['ttft'])} requests", file=sys.stderr)
    finally:
        platform.stop()

    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    for mode, got in modes.items():
        report[mode] = {
            "requests": len(got["ttft"]),
            "failed": len(got["failed"]),
            "ttft_p50_ms": round(statistics.median(got["ttft"]) * 1000, 1),
            "ttft_p99_ms": round(pct(got["ttft"], 0.99), 1),
            "itl_p99_ms": round(pct(got["gaps"], 0.99), 1),
        }
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms"):
        report[f"ratio_{key}"] = round(report["backlog"][key] / report["none"][key], 2)
    report["batch_tokens_per_s_gained"] = round(gained_tokens / gained_s, 1) if gained_s else 0
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
