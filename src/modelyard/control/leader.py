"""Which controller leads: a lease on a PostgreSQL advisory lock, so that of several controllers
on one database exactly one runs the control plane and a standby takes over within a bounded
time when the leader dies.

The leader holds a session-level `pg_try_advisory_lock` on a connection of its own (never a
pooled one: the lock lives exactly as long as that session). The holder calls `acquire()` every
tick (at most `lease_s / 3` apart); the call answers by verb, with no callbacks:

- `ACQUIRED`: this process became the leader now (start the leader's work, resuming from the
  database);
- `LEADING`: still the leader (the connection answered just now);
- `STANDBY`: another process leads;
- `LOST`: this process led and no longer does (the connection failed, or it went unchecked for
  too long): stop the leader's work at once; a later call may acquire again.

Bounds. A leader that dies (SIGKILL, crash) closes its socket and the server frees the lock at
once; a standby leads at its next tick. A leader that hangs or is partitioned away is cut off by
the server: the session is closed after `lease_s` without a query (`idle_session_timeout`) or
when TCP keepalives fail, so a standby leads within about `lease_s` plus a tick. The leader, for
its part, stops calling itself leader `lease_s * 0.8` after its last successful check, before
the server can have handed the lock on: no two processes act as leader at the same time.

With SQLite (one machine, one process: the embedded mode) there is nothing to share and the
process always leads; no lease row is needed for that.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

log = logging.getLogger(__name__)

_SAFETY = 0.8  # of lease_s: how long after its last good check a leader still acts as one


class LeaderState(StrEnum):
    ACQUIRED = "acquired"
    LEADING = "leading"
    STANDBY = "standby"
    LOST = "lost"


def lock_key(name: str) -> int:
    """The advisory lock's 64-bit key for a lease name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def _libpq_url(database_url: str) -> str:
    for prefix in ("postgresql+psycopg://", "postgres://"):
        if database_url.startswith(prefix):
            return "postgresql://" + database_url[len(prefix) :]
    return database_url


class LeaderLease:
    def __init__(
        self, database_url: str, name: str = "modelyard-controller", lease_s: float = 10.0
    ) -> None:
        self.database_url = database_url
        self.name = name
        self.lease_s = lease_s
        self.key = lock_key(name)
        self.single_node = database_url.startswith("sqlite")
        self._conn: Any = None  # psycopg.Connection while leading
        self._checked_at = 0.0  # monotonic time the last good check was sent

    @property
    def is_leader(self) -> bool:
        """True while this process may act as the leader (checked recently enough)."""
        if self.single_node:
            return True
        return (
            self._conn is not None and time.monotonic() - self._checked_at < self.lease_s * _SAFETY
        )

    def acquire(self) -> LeaderState:
        """One tick: check the lease held, or try once to take it. Never blocks for long (a
        connect or query is bounded by about `lease_s / 2`)."""
        if self.single_node:
            return LeaderState.LEADING if self._checked_at else self._first_single()
        if self._conn is not None:
            return self._check()
        return self._try()

    def _first_single(self) -> LeaderState:
        self._checked_at = time.monotonic()
        return LeaderState.ACQUIRED

    def _connect(self) -> Any:
        import psycopg

        ms = max(1000, int(self.lease_s * 1000))
        idle = max(1, int(self.lease_s / 3))
        # Server side: close the session (and free the lock) after lease_s without a query,
        # or when keepalives to a vanished client fail. Client side: give up on a silent
        # server within half a lease.
        options = (
            f"-c idle_session_timeout={ms} -c statement_timeout={ms // 2} "
            f"-c tcp_keepalives_idle={idle} -c tcp_keepalives_interval=1 "
            "-c tcp_keepalives_count=3"
        )
        return psycopg.connect(
            _libpq_url(self.database_url),
            autocommit=True,
            connect_timeout=max(1, int(self.lease_s / 2)),
            keepalives=1,
            keepalives_idle=idle,
            keepalives_interval=1,
            keepalives_count=3,
            tcp_user_timeout=ms // 2,
            options=options,
            application_name=f"modelyard-leader:{self.name}"[:63],
        )

    def _try(self) -> LeaderState:
        started = time.monotonic()
        conn = None
        try:
            conn = self._connect()
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,)).fetchone()
        except Exception as exc:
            log.warning("leader lease %s: cannot reach the database: %s", self.name, exc)
            self._close(conn)
            return LeaderState.STANDBY
        if not (row and row[0]):
            self._close(conn)
            return LeaderState.STANDBY
        self._conn = conn
        self._checked_at = started
        log.info("leader lease %s: acquired", self.name)
        return LeaderState.ACQUIRED

    def _check(self) -> LeaderState:
        """The lock is still ours if our session answers and still holds it."""
        started = time.monotonic()
        if started - self._checked_at >= self.lease_s * _SAFETY:
            # Unchecked for too long (a paused process): the server may have handed the lock
            # on already, so this process has lost it whatever the connection says now.
            return self._lose("unchecked for longer than the lease")
        try:
            row = self._conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND pid = pg_backend_pid() AND objid = (%s::bigint & 4294967295)::oid "
                "AND classid = ((%s::bigint >> 32) & 4294967295)::oid AND objsubid = 1",
                (self.key, self.key),
            ).fetchone()
        except Exception as exc:
            return self._lose(f"the connection failed: {exc}")
        if not (row and row[0]):
            return self._lose("the session no longer holds the lock")
        self._checked_at = started
        return LeaderState.LEADING

    def _lose(self, why: str) -> LeaderState:
        log.warning("leader lease %s: lost (%s)", self.name, why)
        self._close(self._conn)
        self._conn = None
        return LeaderState.LOST

    @staticmethod
    def _close(conn: Any) -> None:
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def release(self) -> None:
        """Step down (a clean stop): the lock is freed for a standby at once."""
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.execute("SELECT pg_advisory_unlock(%s)", (self.key,))
            self._close(self._conn)
            self._conn = None
        if self.single_node:
            self._checked_at = 0.0


class LeaseKeeper:
    """Checks a `LeaderLease` on a thread of its own, every `lease_s / 3`, whatever the event
    loop or a takeover is doing: a takeover that adopts many replicas on a loaded node, or a
    loop stalled by someone else's work, never leaves the lease unchecked past its safety
    margin (which would make the new leader drop its own lease).

    It reports by verbs on the keeper's thread: `on_acquired()` once this process leads (hand it
    to the event loop with `call_soon_threadsafe`), `on_lost()` when it no longer does (step
    down); it goes on trying for the lease after a loss."""

    def __init__(
        self, lease: LeaderLease, on_acquired: Callable[[], None], on_lost: Callable[[], None]
    ) -> None:
        self.lease = lease
        self.on_acquired = on_acquired
        self.on_lost = on_lost
        self.checks = 0  # successful checks while leading (tests read it)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop checking (the caller releases the lease after, from any thread)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        tick = self.lease.lease_s / 3
        while not self._stopping.is_set():
            state = self.lease.acquire()
            if state is LeaderState.LOST:
                self.on_lost()
            elif state is LeaderState.ACQUIRED:
                self.on_acquired()
            elif state is LeaderState.LEADING:
                self.checks += 1
            self._stopping.wait(tick)
