"""The loop-stall guard in the test suite: every process the harnesses start (`modelyard serve`
and its replicas, the cluster's gateways and controllers, a test's own worker) runs with
`MODELYARD_LOOP_STALL_MS` and a stall log file (`core/loop_monitor.py`); a test asserts that
none of them stalled with `assert_no_loop_stalls(...)`.

    from tests.loop_stalls import assert_no_loop_stalls
    platform = PlatformProcess(data_dir, env).start()
    ...  # the hostile requests
    assert_no_loop_stalls(platform)  # also takes RoleProcess, WorkerProcess or a log's Path

A process's replicas inherit its environment, so they write to its log too. On failure the
message names each stall's process, how long it was held and the stack of the work holding it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Protocol

STALL_MS = "250"


class HasStallLog(Protocol):
    stall_log: Path


def stall_log_env(env: dict[str, str] | None = None) -> tuple[Path, dict[str, str]]:
    """A fresh stall log file and the environment that turns the guard on with it, unless
    `env` sets the guard itself (then its log, which may be None)."""
    env = dict(env or {})
    if "MODELYARD_LOOP_STALL_LOG" in env or "MODELYARD_LOOP_STALL_MS" in env:
        return Path(env.get("MODELYARD_LOOP_STALL_LOG") or os.devnull), env
    fd, name = tempfile.mkstemp(prefix="modelyard-loop-stalls-", suffix=".jsonl")
    os.close(fd)
    env["MODELYARD_LOOP_STALL_MS"] = STALL_MS
    env["MODELYARD_LOOP_STALL_LOG"] = name
    return Path(name), env


def read_stalls(log: Path) -> list[dict[str, Any]]:
    """The stalls (`event: stall` lines) written to `log` so far."""
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return []
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if r.get("event") == "stall"]


def describe(stall: dict[str, Any]) -> str:
    others = "".join(
        "\n  another thread at that moment (not parked on a lock, queue or selector):\n    "
        + "\n    ".join(x)
        for x in stall.get("other_threads", [])
    )
    return (
        f"pid {stall['pid']} ({stall['process']}): loop held {stall['stalled_ms']} ms "
        f"(threshold {stall['threshold_ms']} ms) by:\n  " + "\n  ".join(stall["stack"]) + others
    )


def _log(source: HasStallLog | Path) -> Path:
    return source if isinstance(source, Path) else source.stall_log


def stall_counts(*sources: HasStallLog | Path) -> dict[Path, int]:
    """How many stalls each log holds now: pass it as `since` to check only what follows."""
    return {_log(s): len(read_stalls(_log(s))) for s in sources}


def assert_no_loop_stalls(
    *sources: HasStallLog | Path, since: dict[Path, int] | None = None
) -> None:
    """No process writing to these stall logs had its event loop held past the threshold
    (since `stall_counts(...)` was taken, if given)."""
    stalls = []
    for log in dict.fromkeys(_log(s) for s in sources):
        stalls += read_stalls(log)[(since or {}).get(log, 0) :]
    assert not stalls, f"{len(stalls)} event-loop stall(s):\n" + "\n\n".join(
        describe(s) for s in stalls
    )
