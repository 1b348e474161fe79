"""The failure report's process logs (`tests/process_logs.py`): what it shows and what not."""

from __future__ import annotations

import tempfile
from typing import IO, Any

from tests import process_logs


class Started:
    """A process's log as the harness keeps it (a temporary file the child writes through)."""

    def __init__(self, name: str, lines: int) -> None:
        self.name = name
        self.log: IO[Any] = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by the test
        self.log.write("".join(f"{name} line {i}\n" for i in range(lines)))
        self.log.flush()
        process_logs.register(self)

    def label(self) -> str:
        return self.name


def test_a_failure_report_shows_the_end_of_each_held_process_log() -> None:
    serve = Started("serve-under-test", process_logs.TAIL_LINES + 50)
    quiet = Started("quiet-worker", 0)
    shown = dict(process_logs.sections())
    title = f"log of serve-under-test (last {process_logs.TAIL_LINES} of 200 lines)"
    assert title in shown
    text = shown[title].splitlines()
    assert text[0] == "serve-under-test line 50" and text[-1] == "serve-under-test line 199"
    assert not [t for t in shown if "quiet-worker" in t]  # nothing said: no section
    serve.log.seek(0, 2)  # the offset is the child's: reading must not move it
    before = serve.log.tell()
    process_logs.sections()
    assert serve.log.tell() == before
    serve.log.close()
    assert not [t for t in dict(process_logs.sections()) if "serve-under-test" in t]
    quiet.log.close()
