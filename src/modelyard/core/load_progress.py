"""A starting replica's load progress: which phase it is in and how far along.

Phases, in order: `copying` the model files into this node's cache (the control plane, bytes
done of total), `loading` the weights and the KV cache (the worker), `warming` (the engine and
its HTTP server starting), then `ready`. The worker reports its phases in a small JSON file
whose path it is given in `MODELYARD_LOAD_PROGRESS_FILE` (the local backend puts it beside the
replica's log); the control plane reads it when it shows the endpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

LOAD_PROGRESS_ENV = "MODELYARD_LOAD_PROGRESS_FILE"


class LoadPhase(StrEnum):
    COPYING = "copying"
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"


@dataclass(frozen=True)
class LoadProgress:
    phase: LoadPhase
    fraction: float  # of this phase, 0.0-1.0
    bytes_done: int | None = None  # copying only
    bytes_total: int | None = None
    at: float = 0.0  # when it was reported (unix time)

    def view(self) -> dict[str, Any]:
        out: dict[str, Any] = {"phase": self.phase.value, "fraction": round(self.fraction, 4)}
        if self.bytes_total is not None:
            out["bytes_done"], out["bytes_total"] = self.bytes_done, self.bytes_total
        return out


READY = LoadProgress(LoadPhase.READY, 1.0)


def copying(done: int, total: int) -> LoadProgress:
    fraction = 1.0 if total <= 0 else min(1.0, done / total)
    return LoadProgress(LoadPhase.COPYING, fraction, done, total, time.time())


def progress_file_beside(log_path: Path) -> Path:
    """Where a replica whose log is `log_path` reports its progress."""
    return log_path.with_suffix(".progress.json")


def write_progress(path: Path, phase: LoadPhase, fraction: float) -> None:
    """Replace the file at once (a reader never sees half of it)."""
    progress = LoadProgress(phase, max(0.0, min(1.0, fraction)), at=time.time())
    body = {k: (v.value if isinstance(v, LoadPhase) else v) for k, v in asdict(progress).items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


def report(phase: LoadPhase, fraction: float) -> None:
    """The worker's side: write the phase to the file the platform named, if it named one (a
    worker run by hand has none); a progress report never fails a load."""
    path = os.environ.get(LOAD_PROGRESS_ENV)
    if not path:
        return
    with contextlib.suppress(OSError):
        write_progress(Path(path), phase, fraction)


def read_progress(path: Path) -> LoadProgress | None:
    """What the worker last reported; None if nothing (yet) or unreadable."""
    try:
        raw = json.loads(path.read_text())
        phase = LoadPhase(raw["phase"])
        return LoadProgress(phase, float(raw["fraction"]), at=float(raw.get("at") or 0.0))
    except (OSError, ValueError, KeyError, TypeError):
        return None
