"""Usage rows into PostgreSQL as the gateways' writers insert them: what one database holds.

Every answered request is one usage row; each gateway's writer inserts the rows queued since
its last flush (every 50 ms, or at 256 queued) as one statement with the rows as parameters
(`repo.insert_usage`: `INSERT … ON CONFLICT (request_id) DO NOTHING RETURNING`). This inserts
`--rows` rows in batches of `--batch` from `--writers` threads (each its own connection, as
several gateways would), into a fresh database of the machine's PostgreSQL, and reports rows/s
and the CPU the PostgreSQL backends serving the writers spent per row (from /proc: the server
runs on this machine), which is what a PostgreSQL primary's cores carry per request.

    python benchmarks/usage_writes.py [--rows 60000] [--batch 256] [--writers 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway_overhead import cpu_seconds
from sqlalchemy import text

from modelyard.gateway.metering import UsageEvent
from modelyard.store import repository as repo
from modelyard.store.db import Database
from tests.databases import fresh_postgres


def row(i: int) -> dict[str, Any]:
    event = UsageEvent(
        request_id=uuid.uuid4().hex,
        tenant_id=f"tenant-{i % 100}",
        key_id=f"key-{i % 300}",
        endpoint_id=f"ep-{i % 50}",
        model="smollm2",
        version_id=None,
        kind="chat.completions",
        prompt_tokens=120,
        completion_tokens=80,
        cached_tokens=0,
        latency_ms=350.0,
        ttft_ms=40.0,
        status_code=200,
        status="ok",
    )
    return dict(vars(event))


def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    db = Database(url)
    db.migrate()
    per_writer = args.rows // args.writers
    batches = [
        [
            [row(w * per_writer + i + j) for j in range(args.batch)]
            for i in range(0, per_writer, args.batch)
        ]
        for w in range(args.writers)
    ]
    warmed, go = threading.Barrier(args.writers + 1), threading.Barrier(args.writers + 1)

    def writer(mine: list[list[dict[str, Any]]]) -> None:
        # As a gateway's writer: a session (a pooled connection) and a commit per batch. The
        # first batch opens the connections before the clock starts.
        def insert(batch: list[dict[str, Any]]) -> None:
            with db.session() as s:
                repo.insert_usage(s, batch)

        insert(mine[0])
        warmed.wait()
        go.wait()
        for batch in mine[1:]:
            insert(batch)

    threads = [threading.Thread(target=writer, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    warmed.wait()
    with db.session() as s:
        me = int(s.execute(text("SELECT pg_backend_pid()")).scalar_one())
        pids = (
            s.execute(
                text(
                    "SELECT pid FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> :me"
                ),
                {"me": me},
            )
            .scalars()
            .all()
        )
    cpu0 = {int(pid): cpu_seconds(int(pid)) for pid in pids}
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    backend_cpu = sum(cpu_seconds(pid) - c for pid, c in cpu0.items())
    timed = sum(len(b) for mine in batches for b in mine[1:])
    rows = sum(len(b) for mine in batches for b in mine)
    with db.session() as s:
        stored = int(s.execute(text("SELECT count(*) FROM usage_records")).scalar_one())
    db.dispose()
    assert stored == rows, (stored, rows)
    return {
        "rows": rows,
        "batch": args.batch,
        "writers": args.writers,
        "rows_per_s": round(timed / wall),
        "backend_cpu_us_per_row": round(backend_cpu / timed * 1e6, 1),
        "rows_per_backend_core_s": round(timed / backend_cpu) if backend_cpu > 0 else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=60_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with fresh_postgres() as url:
        report = run(url, args)
    print(json.dumps(report, indent=2))
    print(
        f"\n{report['rows_per_s']} usage rows/s from {args.writers} writers; PostgreSQL backends "
        f"{report['backend_cpu_us_per_row']} us CPU per row"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
