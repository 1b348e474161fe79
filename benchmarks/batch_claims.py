"""What a batch item's lease costs: claims per second (claim, then record the result, as the
runner does) on PostgreSQL and SQLite, with 1 and 4 claimers at once, and a check that no item
was claimed twice.

Each claimer is a thread with its own `ItemLeases` (its own lease owner) on one database, so the
claimers contend as several runners would (on PostgreSQL `FOR UPDATE SKIP LOCKED`; on SQLite one
writer at a time). No model runs: this is the database's share of a batch item.

    python benchmarks/batch_claims.py [--items 2000] [--postgres postgresql://postgres@127.0.0.1/test]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import create_engine, text, update

from modelyard.batch.leases import ItemLeases
from modelyard.batch.service import ItemStatus
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import Batch, BatchItem


def seed(db: Database, items: int) -> str:
    with db.session() as s:
        tenant = repo.create_tenant(s, f"bench-{uuid.uuid4().hex[:6]}", None)
        key = repo.add_key(s, tenant.id, "k", uuid.uuid4().hex, "sk-", ["inference"], None, None)
        now = repo.now()
        batch = Batch(
            id=repo.new_id("batch"), tenant_id=tenant.id, key_id=key.id,
            endpoint="/v1/chat/completions", input_file_id="file-x", completion_window="24h",
            status="in_progress", errors=None, output_file_id=None, error_file_id=None,
            metadata_=None, total=items, completed=0, failed=0, created_at=now,
            expires_at=now, in_progress_at=now, finalizing_at=None, completed_at=None,
            failed_at=None, expired_at=None, cancelling_at=None, cancelled_at=None,
            webhook_delivered_at=None,
        )  # fmt: skip
        s.add(batch)
        s.flush()
        s.add_all(
            BatchItem(batch_id=batch.id, line=i, custom_id=f"c-{i}", body={"model": "m"},
                      status=ItemStatus.PENDING)
            for i in range(items)
        )  # fmt: skip
        return batch.id


def run(db: Database, batch_id: str, claimers: int) -> tuple[float, int, int]:
    """(seconds, items claimed, items claimed more than once)."""
    claimed: list[int] = []
    lock = threading.Lock()

    def work(n: int) -> None:
        leases = ItemLeases(db, f"bench-{n}", 30.0)
        while (item := leases.claim(batch_id)) is not None:
            with db.session() as s:  # the item's result, as the runner records it
                s.execute(
                    update(BatchItem)
                    .where(BatchItem.id == item.id, BatchItem.status == ItemStatus.PENDING)
                    .values(status=ItemStatus.DONE, finished_at=repo.now())
                )
            with lock:
                claimed.append(item.id)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(claimers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return elapsed, len(claimed), len(claimed) - len(set(claimed))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{'database':<12}{'claimers':>9}{'items':>8}{'claims/s':>10}{'twice':>7}")
    admin = create_engine(
        args.postgres.replace("postgresql://", "postgresql+psycopg://"),
        isolation_level="AUTOCOMMIT",
    )
    name = f"modelyard_bench_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            urls = {
                "postgresql": f"{args.postgres.rsplit('/', 1)[0]}/{name}",
                "sqlite": f"sqlite:///{Path(tmp) / 'bench.db'}",
            }
            for label, url in urls.items():
                db = Database(url)
                db.migrate()
                for claimers in (1, 4):
                    batch_id = seed(db, args.items)
                    elapsed, n, twice = run(db, batch_id, claimers)
                    print(f"{label:<12}{claimers:>9}{n:>8}{n / elapsed:>10.0f}{twice:>7}")
                db.dispose()
    finally:
        with admin.connect() as conn:
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                {"n": name},
            )
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


if __name__ == "__main__":
    main()
