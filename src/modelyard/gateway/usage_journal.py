"""The usage journal: each answered request's usage row on local disk before the client has the
answer, so a gateway killed right after answering (SIGKILL, OOM) still bills it.

One append-only file per gateway process (`usage-<pid>-<random>.jsonl` in the data dir's
`usage-journal/`), opened with O_APPEND and locked (`flock`) for the process's life. `append`
is one `os.write` of one JSON line, no database round trip: the kernel's page cache keeps the
line when the process dies, so a process crash loses nothing. A crash of the machine itself
(power, kernel) loses the lines the kernel had not written back yet, unless
`usage_journal_fsync` is set, which makes every append wait for the disk.

The usage writer commits rows to the database in batches (`ON CONFLICT (request_id) DO
NOTHING`) and, once everything journaled has been committed, empties the file. At start,
`replay` inserts the rows of every journal in the folder whose owner is gone (its lock is free:
a live process's file is skipped, so two gateways never replay the same one), then deletes it.
Inserting is idempotent, so a row both committed and still journaled is billed once. A line cut
short by a crash in the middle of a write is skipped; it belongs to a request whose answer had
not been sent (the line is written before the answer is).
"""

from __future__ import annotations

import fcntl
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy.exc import InterfaceError, OperationalError

log = logging.getLogger(__name__)

_SUFFIX = ".jsonl"
_REPLAY_BATCH = 1000


class UsageJournal:
    """This process's journal file (see the module's docstring)."""

    def __init__(self, folder: Path, fsync: bool = False) -> None:
        self.folder = folder
        self.fsync = fsync
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = folder / f"usage-{os.getpid()}-{uuid.uuid4().hex[:8]}{_SUFFIX}"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        # Held until this process ends (however it ends): replay skips a file that is locked.
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._dirty = False

    def append(self, row: dict[str, Any]) -> None:
        """Journal one usage row: a single write of one line (atomic for O_APPEND). It is in
        the page cache on return; with `fsync` set the caller then awaits `sync`."""
        os.write(self._fd, orjson.dumps(row) + b"\n")
        self._dirty = True

    def sync(self) -> None:
        """Wait for the disk (a machine crash then loses nothing either)."""
        if self._fd >= 0:
            os.fdatasync(self._fd)

    def committed(self) -> None:
        """Every row journaled so far is in the database: empty the file."""
        if self._dirty:
            os.ftruncate(self._fd, 0)
            self._dirty = False

    def close(self, remove: bool) -> None:
        """Close the file; remove it only if all its rows were committed."""
        if self._fd < 0:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1

    def replay(self, insert: Callable[[list[dict[str, Any]]], int]) -> tuple[int, int]:
        """Insert the rows of every other journal in the folder no live process holds, then
        delete those files; returns (rows read, rows new to the database)."""
        read = new = 0
        for path in sorted(self.folder.glob(f"*{_SUFFIX}")):
            if path == self.path:
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # replayed and removed by another process meanwhile
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its gateway is alive (or another one is replaying it)
                if not path.exists():
                    continue  # removed between our open and our lock
                rows = list(_rows(path))
                for i in range(0, len(rows), _REPLAY_BATCH):
                    new += _insert_or_set_aside(insert, rows[i : i + _REPLAY_BATCH], path)
                read += len(rows)
                path.unlink()
            finally:
                os.close(fd)
        if read:
            log.warning("usage journal: replayed %d rows, %d of them not yet billed", read, new)
        return read, new


def _insert_or_set_aside(
    insert: Callable[[list[dict[str, Any]]], int], rows: list[dict[str, Any]], path: Path
) -> int:
    """Insert a batch; if the database refuses it (not: cannot be reached, which fails the
    start and keeps the journal), insert row by row and set the refused rows aside in
    `<journal>.rejected` for an operator, so one bad row neither blocks the start nor is lost."""
    try:
        return insert(rows)
    except (OperationalError, InterfaceError):
        raise
    except Exception:
        log.exception("usage journal %s: a batch was refused; retrying row by row", path.name)
    new = 0
    for row in rows:
        try:
            new += insert([row])
        except (OperationalError, InterfaceError):
            raise
        except Exception as exc:
            log.error("usage journal %s: row %s refused (%s), set aside", path.name,
                      row.get("request_id"), exc)  # fmt: skip
            with path.with_suffix(".rejected").open("ab") as f:
                f.write(orjson.dumps(row) + b"\n")
    return new


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            try:
                row = orjson.loads(line)
                row["created_at"] = datetime.fromisoformat(row["created_at"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                # A line cut short by a crash mid-write: its answer was never sent.
                log.warning("usage journal %s: line %d unreadable, skipped", path.name, number)
                continue
            yield row
