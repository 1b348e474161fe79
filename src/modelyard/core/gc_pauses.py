"""Garbage-collection pauses of this process: how long the collector has run in all (the
loop-stall guard takes that time off a late heartbeat, as it does the OS's run-queue wait, so a
collection is not blamed on the work it interrupted), each pause longer than a threshold kept
for the guard to report as a pause, and the heap frozen once a process has started.

CPython's cyclic collector runs in whichever thread allocates when a generation's count is
reached, holding the GIL: every thread, the event loop's included, waits for it. A full (gen 2)
collection walks every tracked object, so its pause grows with the heap: about 50 ms for the
~300,000 objects a server has after its imports on a 2 vCPU AMD EPYC, hundreds of ms on a busy
machine. `freeze_startup_heap` moves what startup built (modules, the app, a model's Python
objects) into the permanent generation after one last collection, so later full collections
walk only what serving allocates since (the practice of vLLM's engine and of large Django
deployments). Reference counting still frees frozen objects; only cycles among them are never
collected again.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GcPause:
    """One collection longer than the clock's threshold."""

    generation: int
    seconds: float
    collected: int
    at: float  # time.time() when it ended


class GcClock:
    """Times every collection of this process while started (a `gc.callbacks` entry)."""

    def __init__(self, long_s: float) -> None:
        self.long_s = long_s
        self.total_s = 0.0  # collector time since start (read by another thread: a float store)
        self.long: deque[GcPause] = deque(maxlen=100)  # drained by the reader
        self._began = 0.0
        # From this clock's start callback to its stop callback's adding of the time: another
        # thread that runs then (a callback's Python code may give up the GIL, this one's or
        # another library's) must not judge time the collection has not yet been counted for.
        self.collecting = False

    def start(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._began = now
            self.collecting = True
            return
        took = now - self._began
        self.total_s += took
        self.collecting = False
        if took > self.long_s:
            self.long.append(
                GcPause(info.get("generation", -1), took, info.get("collected", 0), time.time())
            )

    def drain(self) -> list[GcPause]:
        """The long pauses since the last call."""
        pauses = []
        while self.long:
            pauses.append(self.long.popleft())
        return pauses


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now out of the collector's reach (see the
    module's docstring). Call it when a process has started, before it serves."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info(
        "startup heap frozen: %d objects out of the collector's walks (%.0f ms)",
        gc.get_freeze_count(),
        (time.perf_counter() - started) * 1000,
    )


_freeze_on_start = False


def freeze_heap_when_started() -> None:
    """From a process's entry point, before it serves: its app's startup (`heap_started`)
    freezes the heap once done. Not for apps run inside another program (tests, an embedder):
    every app started there would keep its cycles for good."""
    global _freeze_on_start
    _freeze_on_start = True


def heap_started() -> None:
    """An app's startup is done: freeze the heap, once, if the entry point asked for it."""
    global _freeze_on_start
    if _freeze_on_start:
        _freeze_on_start = False
        freeze_startup_heap()
