"""The logs of every process the tests start, for the report of a test that fails.

`PlatformProcess`, `WorkerProcess` and `RoleProcess` register themselves when made; the
`pytest_runtest_makereport` hook in `tests/conftest.py` appends the end of each registered
process's log to a failing test's report (a section per process), so a failure shows what
`serve`, its workers and the cluster's roles said without re-running it.
"""

from __future__ import annotations

import os
import weakref
from typing import IO, Any, Protocol

# Lines of each log a failure report carries: the end, where a failure usually is.
TAIL_LINES = 150


class Logged(Protocol):
    """A process a test started, with its combined stdout and stderr in a file."""

    log: IO[Any]

    def label(self) -> str: ...


_live: weakref.WeakSet[Any] = weakref.WeakSet()  # processes still referenced by a test


def register(process: Logged) -> None:
    _live.add(process)


def read_log(log: IO[Any]) -> str:
    """All of a log file so far, without moving its offset (the child writes through it)."""
    if log.closed:
        return ""
    fd = log.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def sections() -> list[tuple[str, str]]:
    """(title, the log's last lines) for every process a test still holds."""
    found = []
    for process in list(_live):
        lines = read_log(process.log).splitlines()
        if not lines:
            continue
        shown = "\n".join(lines[-TAIL_LINES:])
        cut = f" (last {TAIL_LINES} of {len(lines)} lines)" if len(lines) > TAIL_LINES else ""
        found.append((f"log of {process.label()}{cut}", shown))
    return sorted(found)
