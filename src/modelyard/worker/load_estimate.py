"""What a loading worker reports: how far its engine's load is (`core.load_progress`).

While the engine loads, `loading`'s fraction is estimated from how much this process's
resident memory has grown against the size of the weight files it reads (a GGUF's float32
conversion when it is cached: measured on SmolLM2, the resident memory grows by about that
much over the load), polled in a thread since the load holds the main thread; the estimate
stops at 0.99 until the load returns. Then `warming` until the HTTP server answers, when the
control plane sees the replica ready. A worker run by hand (no progress file named) skips all
of it.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from modelyard.core.load_progress import LOAD_PROGRESS_ENV, LoadPhase, report

_POLL_S = 0.25
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".onnx")


def weight_bytes(model: str | Path, cache_dir: Path | None = None) -> int:
    """Bytes of the weight files the engine will read (0 if they cannot be found): a GGUF's
    float32 conversion when `cache_dir` holds it (what is loaded; about 5x a 4-bit file),
    else the file itself."""
    from modelyard.engine.client import resolve_model_path

    try:
        path = resolve_model_path(model)
    except (OSError, ValueError):
        return 0
    if path.is_file() and path.suffix == ".gguf" and cache_dir is not None:
        converted = _converted_folder(path.resolve(), cache_dir / "converted")
        if converted is not None:
            path = converted
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES))


def _converted_folder(gguf_path: Path, converted: Path) -> Path | None:
    """The folder `engine.models.gguf_convert` converted `gguf_path` into (its source.json
    names the file), found without hashing the file."""
    try:
        for source in converted.glob("*/source.json"):
            if json.loads(source.read_text()).get("gguf") == str(gguf_path):
                return source.parent
    except (OSError, ValueError):
        return None
    return None


def resident_bytes() -> int | None:
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def reporting_load(model: str | Path, cache_dir: Path | None = None) -> Iterator[None]:
    """Report `loading` (with its estimated fraction) around the block, then `warming`."""
    if not os.environ.get(LOAD_PROGRESS_ENV):
        yield
        return
    report(LoadPhase.LOADING, 0.0)
    expected, start = weight_bytes(model, cache_dir), resident_bytes()
    stop = threading.Event()

    def watch() -> None:
        best = 0.0
        while not stop.wait(_POLL_S):
            now = resident_bytes()
            if now is None or start is None or expected <= 0:
                return
            fraction = min(0.99, max(0.0, (now - start) / expected))
            if fraction > best + 0.01:
                best = fraction
                report(LoadPhase.LOADING, fraction)

    watcher = threading.Thread(target=watch, name="load-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join(1.0)
    report(LoadPhase.WARMING, 0.0)
