"""Batch runners sharing one database (as standby controllers will): two real `BatchRunner`s in
two processes (`tests/batch_runner_proc.py`) work on one batch, each claiming items with leases
(PostgreSQL: `FOR UPDATE SKIP LOCKED`; SQLite: one writer at a time), and every custom_id ends up
exactly once in the results and the usage; SIGKILL one runner mid-batch and the other takes over
its expired leases and finishes, still exactly once. The sender is a stand-in that logs what
each runner sent (what is under test is who sends and records which item, and a deterministic
log needs the stand-in; the gateway path is covered by tests/batch/test_batch.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import select

from modelyard.batch.files import FileService
from modelyard.batch.leases import ItemLeases
from modelyard.batch.service import BatchService
from modelyard.batch.webhook_policy import WebhookPolicy
from modelyard.core.identity import Limits, Principal
from modelyard.store import repository as repo
from modelyard.store.artifacts import ArtifactStore
from modelyard.store.db import Database
from modelyard.store.tables import Batch, BatchItem, UsageRecord
from tests.databases import fresh_postgres
from tests.platform_harness import batch_line, jsonl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'shared.db'}"
        return
    with fresh_postgres() as url:
        yield url


class Shared:
    """The database and data dir the runners share, and the batch they work on."""

    def __init__(self, url: str, data: Path) -> None:
        self.url = url
        self.data = data
        self.log = data / "sent.log"
        self.db = Database(url)
        self.db.migrate()
        self.files = FileService(self.db, ArtifactStore(data / "artifacts"), 1 << 30)
        self.batches = BatchService(self.db, self.files, WebhookPolicy([]))
        with self.db.session() as s:
            t = repo.create_tenant(s, "leases", None)
            k = repo.add_key(s, t.id, "k", "hash-leases", "sk-", ["inference"], None, None)
            self.who = Principal(k.id, "k", t.id, "leases", frozenset({"inference"}),
                                 Limits(None, None), None, False)  # fmt: skip

    def batch(self, n: int) -> str:
        source = self.data / "in.jsonl"
        source.write_bytes(jsonl([batch_line(f"item-{i}") for i in range(n)]))
        f = self.files.create_from_path(self.who.tenant_id, source, "in.jsonl", "batch")
        created = self.batches.create(self.who, f["id"], "/v1/chat/completions", "24h", None)
        return str(created["id"])

    def wait(self, batch_id: str, status: str, within_s: float = 60) -> dict:
        deadline = time.monotonic() + within_s
        while True:
            view = self.batches.get(self.who.tenant_id, batch_id)
            if view["status"] == status:
                return view
            assert time.monotonic() < deadline, view
            time.sleep(0.1)

    def sent(self) -> list[tuple[str, str]]:
        """(runner, request id) of every item a runner sent, in order."""
        if not self.log.exists():
            return []
        return [tuple(line.split()[1:3]) for line in self.log.read_text().splitlines()]  # type: ignore[misc]

    def results(self, batch_id: str) -> tuple[list[str], dict[str, str]]:
        """The output file's custom_ids, and which runner recorded each item."""
        view = self.batches.get(self.who.tenant_id, batch_id)
        path = self.files.find_content_path(self.who.tenant_id, view["output_file_id"])
        assert path is not None
        out = [json.loads(line)["custom_id"] for line in path.read_text().splitlines()]
        with self.db.session() as s:
            owners = dict(s.execute(select(BatchItem.custom_id, BatchItem.lease_owner)).all())
        return out, owners

    def usage_ids(self) -> list[str]:
        with self.db.session() as s:
            return list(s.scalars(select(UsageRecord.request_id)))


@contextmanager
def runners(shared: Shared, lease_s: float, hold_s: float, *owners: str) -> Iterator[dict]:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for owner in owners:
            cmd = [
                sys.executable, "-m", "tests.batch_runner_proc", "--db", shared.url,
                "--data", str(shared.data), "--owner", owner, "--log", str(shared.log),
                "--lease", str(lease_s), "--hold", str(hold_s),
            ]  # fmt: skip
            procs[owner] = subprocess.Popen(cmd, cwd=ROOT)
        deadline = time.monotonic() + 60
        while not all((shared.data / f"ready-{o}").exists() for o in owners):
            assert all(p.poll() is None for p in procs.values()), "a runner exited"
            assert time.monotonic() < deadline, "the runners did not start"
            time.sleep(0.05)
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait(15)


def test_two_runners_share_a_batch_each_item_once(db_url: str, tmp_path: Path) -> None:
    shared = Shared(db_url, tmp_path)
    with runners(shared, 5.0, 0.1, "runner-a", "runner-b"):
        batch = shared.batch(40)
        view = shared.wait(batch, "completed")
    assert view["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    out, owners = shared.results(batch)
    assert sorted(out) == sorted(f"item-{i}" for i in range(40))  # each exactly once
    sent = shared.sent()
    assert len(sent) == len({rid for _, rid in sent}) == 40  # no item was sent twice
    assert set(Counter(owner for owner, _ in sent)) == {"runner-a", "runner-b"}  # both worked
    assert set(owners.values()) == {"runner-a", "runner-b"}
    usage = shared.usage_ids()
    assert len(usage) == len(set(usage)) == 40


def test_a_killed_runners_items_are_taken_over_once_their_leases_expire(
    db_url: str, tmp_path: Path
) -> None:
    shared = Shared(db_url, tmp_path)
    with runners(shared, 1.5, 0.25, "runner-a", "runner-b") as procs:
        batch = shared.batch(40)
        deadline = time.monotonic() + 60
        while sum(1 for owner, _ in shared.sent() if owner == "runner-a") < 6:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        procs["runner-a"].send_signal(signal.SIGKILL)
        procs["runner-a"].wait()
        killed_at = len(shared.sent())
        view = shared.wait(batch, "completed")
    assert view["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    out, owners = shared.results(batch)
    assert sorted(out) == sorted(f"item-{i}" for i in range(40))  # each exactly once
    usage = shared.usage_ids()
    assert len(usage) == len(set(usage)) == 40
    sent = shared.sent()
    by_a = {rid for owner, rid in sent if owner == "runner-a"}
    by_b = {rid for owner, rid in sent if owner == "runner-b"}
    retaken = by_a & by_b
    # What runner-a had in flight when it died was sent again by runner-b, after its lease ran
    # out; nothing runner-a had recorded was sent again, and runner-b recorded the rest.
    assert retaken and len(retaken) <= 4
    assert all(rid in {r for _, r in sent[killed_at:]} for rid in retaken)
    with shared.db.session() as s:
        recorded_by = dict(s.execute(select(BatchItem.request_id, BatchItem.lease_owner)).all())
    assert all(recorded_by[rid] == "runner-b" for rid in retaken)
    assert set(owners.values()) == {"runner-a", "runner-b"}


def test_claims_skip_live_leases_and_take_expired_ones(db_url: str, tmp_path: Path) -> None:
    shared = Shared(db_url, tmp_path)
    batch = shared.batch(3)
    from modelyard.batch.intake import validate_batch

    with shared.db.session() as s:
        row = s.get(Batch, batch)
        assert row is not None
    validate_batch(shared.db, shared.files, row)
    a = ItemLeases(shared.db, "a", lease_s=60)
    b = ItemLeases(shared.db, "b", lease_s=0.2)
    first = a.claim(batch)
    second = b.claim(batch)
    third = b.claim(batch)
    assert first and second and third
    assert len({first.id, second.id, third.id}) == 3
    assert a.claim(batch) is None  # all three are held
    assert b.renew({second.id, third.id}) == {second.id, third.id}
    assert a.renew({second.id}) == set()  # not a's to renew
    time.sleep(0.5)  # b's leases expire
    taken = {x.id for x in (a.claim(batch), a.claim(batch)) if x}
    assert taken == {second.id, third.id}
    assert b.renew({second.id, third.id}) == set()  # b learns it lost them
    assert a.release() == 3 and b.claim(batch) is not None  # given back: claimable at once
    assert a.pending(batch) == 3
