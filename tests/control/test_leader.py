"""The leader lease of controllers (`control/leader.py`) with real processes on PostgreSQL: one
leads and the other stands by; SIGKILL the leader and the standby leads within the lease bound;
freeze the leader (SIGSTOP) and the standby leads once the server cuts the silent session off,
while the frozen one, woken, reports it lost the lease before anything else. With SQLite (one
node) the process always leads."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from modelyard.control.leader import LeaderLease, LeaderState, LeaseKeeper
from tests.databases import POSTGRES_ADMIN_URL, postgres_unreachable, skip_or_fail

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 2.0


@pytest.fixture()
def pg_url() -> str:
    reason = postgres_unreachable()
    if reason:
        skip_or_fail(reason)
    return POSTGRES_ADMIN_URL


class Log:
    def __init__(self, path: Path) -> None:
        self.path = path

    def events(self) -> list[tuple[str, str, float]]:
        if not self.path.exists():
            return []
        rows = [line.split() for line in self.path.read_text().splitlines()]
        return [(owner, state, float(at)) for owner, state, at in rows]

    def wait(self, owner: str, state: str, within_s: float = 30) -> float:
        """The time `owner` reported `state` (the first time after the events seen so far)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for o, s, at in self.events():
                if (o, s) == (owner, state):
                    return at
            time.sleep(0.05)
        raise AssertionError(f"{owner} never reported {state}: {self.events()}")


@contextmanager
def controllers(url: str, name: str, log: Path, *owners: str) -> Iterator[dict]:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for owner in owners:
            cmd = [
                sys.executable, "-m", "tests.leader_proc", "--db", url, "--name", name,
                "--owner", owner, "--lease", str(LEASE_S), "--log", str(log),
            ]  # fmt: skip
            procs[owner] = subprocess.Popen(cmd, cwd=ROOT)
            # The first owner leads (its second tick says so) before any other starts, so a
            # test that freezes or kills it acts on an established leader.
            Log(log).wait(owner, "leading" if owner == owners[0] else "standby")
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_the_standby_leads_when_the_leader_is_killed(pg_url: str, tmp_path: Path) -> None:
    log = Log(tmp_path / "leader.log")
    name = f"test-{time.time_ns()}"
    with controllers(pg_url, name, log.path, "first", "second") as procs:
        procs["first"].send_signal(signal.SIGKILL)
        procs["first"].wait()
        killed = time.time()
        took_over = log.wait("second", "acquired")
    # The dead leader's socket closes with it, so the lock is free at once: one tick later
    # (lease / 5), well within the bound of a lease.
    assert took_over - killed < LEASE_S
    assert [s for o, s, _ in log.events() if o == "second"][:2] == ["standby", "acquired"]


def test_a_frozen_leader_is_cut_off_and_knows_it_when_it_wakes(pg_url: str, tmp_path: Path) -> None:
    log = Log(tmp_path / "leader.log")
    name = f"test-{time.time_ns()}"
    with controllers(pg_url, name, log.path, "first", "second") as procs:
        first = procs["first"]
        first.send_signal(signal.SIGSTOP)
        frozen = time.time()
        took_over = log.wait("second", "acquired")
        first.send_signal(signal.SIGCONT)
        lost = log.wait("first", "lost")
        log.wait("first", "standby")
    # The server closed the silent session a lease after its last query (idle_session_timeout)
    # and the standby took over: never before the frozen leader's own bound (0.8 of a lease
    # after its last check, at most one tick before it froze) had run out.
    assert LEASE_S * 0.8 - LEASE_S / 5 <= took_over - frozen < LEASE_S * 3
    assert lost > took_over
    # Woken, the old leader's first word was that it lost the lease, then it stood by.
    states = [s for o, s, _ in log.events() if o == "first"]
    assert states == ["acquired", "leading", "lost", "standby"]


def test_release_hands_over_at_once_and_sqlite_always_leads(pg_url: str, tmp_path: Path) -> None:
    name = f"test-{time.time_ns()}"
    a, b = LeaderLease(pg_url, name, LEASE_S), LeaderLease(pg_url, name, LEASE_S)
    try:
        assert a.acquire() is LeaderState.ACQUIRED and a.is_leader
        assert b.acquire() is LeaderState.STANDBY and not b.is_leader
        assert a.acquire() is LeaderState.LEADING
        a.release()
        assert not a.is_leader
        assert b.acquire() is LeaderState.ACQUIRED
        assert a.acquire() is LeaderState.STANDBY
    finally:
        a.release()
        b.release()
    single = LeaderLease(f"sqlite:///{tmp_path / 'db.sqlite'}")
    assert single.acquire() is LeaderState.ACQUIRED
    assert single.acquire() is LeaderState.LEADING and single.is_leader


def test_the_lease_is_checked_while_a_takeover_is_still_running(pg_url: str) -> None:
    """A takeover that outlasts the lease's safety margin (adopting many replicas on a loaded
    node) must not make the new leader drop its own lease: the keeper checks it on a thread of
    its own while the takeover runs elsewhere (the controller's event loop; a thread here). The
    takeover finishes only after three more good checks (1.5 leases, past the 0.8 margin)."""
    import asyncio

    name = f"test-{time.time_ns()}"
    lease = LeaderLease(pg_url, name, LEASE_S)
    lost: list[str] = []

    async def run() -> int:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        async def slow_takeover() -> None:
            while keeper.checks < 3 and not lost:  # noqa: ASYNC110 - set by the keeper thread
                await asyncio.sleep(0.05)
            done.set_result(keeper.checks)

        keeper = LeaseKeeper(
            lease,
            on_acquired=lambda: loop.call_soon_threadsafe(loop.create_task, slow_takeover()),
            on_lost=lambda: lost.append("lost"),
        )
        keeper.start()
        try:
            return await asyncio.wait_for(done, 60)
        finally:
            await asyncio.to_thread(keeper.stop)

    try:
        assert asyncio.run(run()) >= 3
        assert not lost and lease.is_leader
    finally:
        lease.release()
