"""The usage journal (gateway/usage_journal.py) under the usage recorder: a row is on disk when
`record` returns, a process SIGKILLed before its writer flushed loses nothing (its journal is
replayed at the next start), replay is idempotent, a torn last line is skipped, a live
process's journal is left alone, and the journal is emptied once its rows are committed.

Real SQLite databases and, for the crash, a real process killed with SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import select

from modelyard.gateway.metering import UsageEvent, UsageRecorder
from modelyard.gateway.usage_journal import UsageJournal
from modelyard.store import repository as repo
from modelyard.store.db import Database, sqlite_url
from modelyard.store.tables import UsageRecord


def event(request_id: str) -> UsageEvent:
    return UsageEvent(request_id, "t", "k", None, "m", None, "chat.completions",
                      3, 4, 0, 1.0, None, 200, "ok")  # fmt: skip


async def report(recorder: UsageRecorder, e: UsageEvent) -> None:
    """A finished request reported as the gateway does: claimed (a duplicate is dropped),
    then written."""
    first, _ = recorder.claim(e)
    if first:
        await recorder.write(e)


def rows_in(db: Database) -> list[str]:
    with db.session() as s:
        return sorted(s.scalars(select(UsageRecord.request_id)))


def insert(db: Database) -> Callable[[list[dict[str, Any]]], int]:
    def run(rows: list[dict[str, Any]]) -> int:
        with db.session() as s:
            return repo.insert_usage(s, rows)

    return run


def journal_lines(folder: Path) -> list[bytes]:
    return [line for p in folder.glob("*.jsonl") for line in p.read_bytes().splitlines()]


_CRASHING_GATEWAY = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    from modelyard.gateway.metering import UsageEvent, UsageRecorder
    from modelyard.gateway.usage_journal import UsageJournal
    from modelyard.store.db import Database

    async def main() -> None:
        db = Database(sys.argv[1])
        # A writer that would flush only after an hour: the rows are in memory and journal.
        recorder = UsageRecorder(db, flush_interval_s=3600,
                                 journal=UsageJournal(Path(sys.argv[2])))
        recorder.start()
        for i in range(3):
            await recorder.write(UsageEvent(f"req-{i}", "t", "k", None, "m", None,
                                            "chat.completions", 3, 4, 0, 1.0, None, 200, "ok"))
        print("answered", flush=True)  # what a gateway would now send to its clients
        time.sleep(3600)

    asyncio.run(main())
    """
)


def test_rows_recorded_just_before_a_sigkill_are_billed_at_the_next_start(
    database: Database, tmp_path: Path
) -> None:
    folder = tmp_path / "usage-journal"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_GATEWAY, database.url, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "answered"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert rows_in(database) == []  # the writer never ran
    assert len(journal_lines(folder)) == 3
    # The next start: its own new journal, and the dead process's replayed and removed.
    journal = UsageJournal(folder)
    recorder = UsageRecorder(database, journal=journal)
    asyncio.run(recorder.recover())
    assert rows_in(database) == ["req-0", "req-1", "req-2"]
    assert [p for p in folder.iterdir()] == [journal.path]
    journal.close(remove=True)


def test_replay_is_idempotent(database: Database, tmp_path: Path) -> None:
    """A row committed and still journaled (killed between the commit and the truncation), or
    a journal replayed twice, is billed once."""
    folder = tmp_path / "j"
    dead = UsageJournal(folder)
    rows = [asdict(event(f"r-{i}")) for i in range(3)]
    for row in rows:
        dead.append(row)
    copy = folder / "usage-copy.jsonl"
    copy.write_bytes(dead.path.read_bytes())
    dead.close(remove=False)  # as its process dying would: the lock is released
    with database.session() as s:
        assert repo.insert_usage(s, rows[:1]) == 1
    live = UsageJournal(folder)
    assert live.replay(insert(database)) == (6, 2)
    assert rows_in(database) == ["r-0", "r-1", "r-2"]
    assert live.replay(insert(database)) == (0, 0)
    live.close(remove=True)
    assert list(folder.iterdir()) == []


def test_a_torn_last_line_is_skipped(database: Database, tmp_path: Path) -> None:
    """A crash in the middle of a write leaves half a line: the rows before it are billed."""
    folder = tmp_path / "j"
    dead = UsageJournal(folder)
    for i in range(2):
        dead.append(asdict(event(f"ok-{i}")))
    whole = orjson.dumps(event("torn").__dict__)
    with dead.path.open("ab") as f:
        f.write(whole[: len(whole) // 2])
    dead.close(remove=False)
    live = UsageJournal(folder)
    assert live.replay(insert(database)) == (2, 2)
    assert rows_in(database) == ["ok-0", "ok-1"]
    live.close(remove=True)


def test_a_live_gateways_journal_is_not_replayed(database: Database, tmp_path: Path) -> None:
    """Two gateways on one data dir: one's start never bills (or deletes) the other's rows."""
    folder = tmp_path / "j"
    other = UsageJournal(folder)
    other.append(asdict(event("other")))
    starting = UsageJournal(folder)
    assert starting.replay(insert(database)) == (0, 0)
    assert other.path.exists() and rows_in(database) == []
    other.close(remove=False)
    starting.close(remove=True)


async def test_the_journal_is_emptied_once_its_rows_are_committed(
    database: Database, tmp_path: Path
) -> None:
    folder = tmp_path / "j"
    journal = UsageJournal(folder)
    recorder = UsageRecorder(database, journal=journal)
    recorder.start()
    for i in range(3):
        await report(recorder, event(f"e-{i}"))
    # On disk as soon as `write` returns, before the writer ran.
    assert len(journal.path.read_bytes().splitlines()) == 3
    for _ in range(200):
        if recorder.written == 3 and journal.path.stat().st_size == 0:
            break
        await asyncio.sleep(0.02)
    assert recorder.written == 3 and journal.path.stat().st_size == 0
    # A duplicate report is neither billed nor journaled again.
    await report(recorder, event("e-0"))
    assert journal.path.stat().st_size == 0
    await report(recorder, event("e-3"))
    await recorder.stop()
    assert rows_in(database) == ["e-0", "e-1", "e-2", "e-3"]
    assert not journal.path.exists()  # a clean stop leaves no journal behind


async def test_a_journal_whose_rows_could_not_be_written_is_kept(tmp_path: Path) -> None:
    """With the database unreachable at stop, the rows stay journaled for the next start."""
    folder = tmp_path / "j"
    db = Database(sqlite_url(tmp_path / "no-schema.db"))  # no tables: every insert fails
    journal = UsageJournal(folder)
    recorder = UsageRecorder(db, flush_interval_s=3600, journal=journal)
    await report(recorder, event("kept"))
    with pytest.raises(Exception):  # noqa: B017 - the driver's error, whatever it is
        await recorder.stop()
    db.dispose()
    assert journal.path.exists() and len(journal_lines(folder)) == 1
    assert os.stat(journal.path).st_mode & 0o777 == 0o600


async def test_a_flush_waits_for_the_batch_another_flush_is_writing(
    database: Database, tmp_path: Path
) -> None:
    """The usage export flushes before it reads: a flush that finds nothing queued because the
    background writer has taken the batch must wait until that batch is committed (or the
    export misses rows already answered), and must not empty the journal before then."""
    import sqlite3

    journal = UsageJournal(tmp_path / "j")
    recorder = UsageRecorder(database, journal=journal)
    await report(recorder, event("in-flight"))
    blocker = sqlite3.connect(str(database.engine.url.database), isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # the writer's insert waits for this lock
    try:
        writing = asyncio.create_task(recorder.flush())
        for _ in range(100):
            if not recorder._pending:  # taken by the first flush, now waiting on the lock
                break
            await asyncio.sleep(0.01)
        assert not recorder._pending
        reading = asyncio.create_task(recorder.flush())  # the export's
        await asyncio.sleep(0.3)  # an absence, watched for a while (no state says "still waits")
        assert not reading.done()  # it waits for the batch in flight
        assert len(journal.path.read_bytes().splitlines()) == 1  # still on disk
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    await reading
    assert rows_in(database) == ["in-flight"]  # committed when the export's flush returns
    await writing
    assert journal.path.stat().st_size == 0
    await recorder.stop()


def test_a_row_the_database_refuses_is_set_aside_not_blocking_the_start(
    database: Database, tmp_path: Path
) -> None:
    """A row the database refuses (here one lacking a required field, as from another version)
    must not stop the platform from starting: the good rows are billed, the refused one kept
    for an operator."""
    folder = tmp_path / "j"
    dead = UsageJournal(folder)
    dead.append(asdict(event("good")))
    dead.append({k: v for k, v in asdict(event("odd")).items() if k != "model"})
    dead.close(remove=False)
    live = UsageJournal(folder)
    assert live.replay(insert(database)) == (2, 1)
    assert rows_in(database) == ["good"]
    (rejected,) = folder.glob("*.rejected")
    assert b'"odd"' in rejected.read_bytes()
    live.close(remove=True)
