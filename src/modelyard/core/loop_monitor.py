"""The loop-stall guard: a watchdog thread that catches an asyncio event loop held by one piece
of work for longer than a threshold, and records that work's stack.

The loop runs a heartbeat every `interval` (a fifth of the threshold). The watchdog wakes as
often and looks at the heartbeat that is due: once it is overdue by more than the threshold, it
samples the loop thread's stack (`sys._current_frames`). It is a stall only if the loop thread is
then executing a callback or a task's code. A loop thread found in the loop's own machinery
(idle in the selector's wait, or between callbacks) was not held by any work, only not run:
the OS did not schedule it, or it waits for the GIL. Time the loop thread spent runnable
but not running (its run-queue wait, `/proc/self/task/<tid>/schedstat` on Linux) is
taken off the overdue time too, so work descheduled by a loaded machine is not blamed for the
machine's load, and so is the time the garbage collector ran (`gc_pauses.py`): a collection
holds every thread, wherever the loop was when it began. A collection longer than the threshold
is logged and counted as a pause of its own (`modelyard_gc_long_pauses_total`; `event: gc_pause`
in the log file), not as a stall of the work it interrupted. Work that holds the GIL (one long
C call) keeps the watchdog from running at all: the watchdog reads the stack first thing when
it gets the GIL back, while that work is still on the stack.

A stall is logged (WARNING, with the stack), counted (`modelyard_event_loop_stalls_total`, and
its length once it ends in `modelyard_event_loop_stall_seconds`) and, with a log file, appended
there as one JSON line (the test suite reads these). One monitor per process at a time: its
series are what `loop_stall_families` and `LoopStallCollector` expose.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import linecache
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from modelyard.config import TelemetrySettings
from modelyard.core.gc_pauses import GcClock, GcPause

log = logging.getLogger(__name__)

_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_MAX_FRAMES = 60
_COROUTINE_FLAGS = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
# The loop's own frames (pure-Python asyncio; uvloop has none): running them is not work.
_MACHINERY = {
    ("base_events.py", "run_forever"),
    ("base_events.py", "run_until_complete"),
    ("base_events.py", "_run_once"),
    ("events.py", "_run"),
}
_ASYNCIO_DIR = os.path.dirname(asyncio.__file__)


def _is_machinery(frame: FrameType) -> bool:
    path = frame.f_code.co_filename
    if path.endswith("selectors.py"):
        return True
    folder, name = os.path.split(path)
    return folder == _ASYNCIO_DIR and (name, frame.f_code.co_name) in _MACHINERY


_Where = tuple[str, int, str]  # file, line, function


def _format(frames: list[_Where]) -> list[str]:
    """`frames` innermost first, as traceback lines outermost first (at most _MAX_FRAMES)."""
    lines = []
    for path, line, function in reversed(frames[:_MAX_FRAMES]):
        source = linecache.getline(path, line).strip()
        lines.append(f'File "{path}", line {line}, in {function}')
        if source:
            lines.append(f"    {source}")
    return lines


_WAITS = ("threading.py", "queue.py", "selectors.py", "concurrent/futures/thread.py")


def _running_threads(frames: dict[int, FrameType], loop_thread: int) -> list[list[_Where]]:
    """The innermost frames (at most 8) of the threads other than the loop's and this one
    that are not waiting on a lock, queue or selector; at most 4 threads."""
    found = []
    for ident, top in frames.items():
        if ident in (loop_thread, threading.get_ident()) or top.f_code.co_filename.endswith(_WAITS):
            continue
        where: list[_Where] = []
        f: FrameType | None = top
        while f is not None and len(where) < 8:
            where.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
            f = f.f_back
        found.append(where)
    return found[:4]


def _runqueue_ns(native_id: int) -> int:
    """Nanoseconds the thread has spent runnable but not running (0 where not known)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class Stall:
    """One stall: found when `stalled_s` long, with the stack of the work holding the loop;
    `duration_s` once it ended."""

    stalled_s: float
    stack: list[str]
    beat: int = 0
    # Other threads not parked at that moment (innermost frames): one that held the GIL in a long
    # C call kept the loop waiting, wherever the loop's own stack was.
    others: list[list[str]] = field(default_factory=list)
    due: float = 0.0
    runqueue_mark: int = 0
    gc_mark: float = 0.0
    duration_s: float | None = None
    at: float = field(default_factory=time.time)


class LoopMonitor:
    """Watches the event loop it is started on (see the module's docstring)."""

    def __init__(
        self, threshold_s: float, log_path: Path | None = None, interval_s: float | None = None
    ) -> None:
        if threshold_s <= 0:
            raise ValueError("threshold_s must be positive")
        self.threshold_s = threshold_s
        self.interval_s = interval_s or min(max(threshold_s / 5, 0.005), 0.1)
        self.log_path = log_path
        self.stalls: list[Stall] = []  # this process's, newest last (bounded below)
        self.beats = 0  # heartbeats the loop has run
        self.max_overdue_s = 0.0  # the latest the watchdog has seen a heartbeat (diagnostics)
        self.registry = CollectorRegistry()
        self.count = Counter(
            "modelyard_event_loop_stalls",
            "Times this process's event loop was held by one piece of work for longer than "
            "loop_stall_ms (the stack is in the process's log).",
            registry=self.registry,
        )
        self.seconds = Histogram(
            "modelyard_event_loop_stall_seconds",
            "How long each stall of this process's event loop lasted.",
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.gc_pauses = Counter(
            "modelyard_gc_long_pauses",
            "Garbage collections of this process that held every thread, its event loop's too, "
            "for longer than loop_stall_ms.",
            registry=self.registry,
        )
        self.gc = GcClock(threshold_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_id = 0
        self._native_id = 0
        self._base: FrameType | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._pending = (0, 0.0)  # (heartbeat number, when it is due), set by the loop
        self._ran = (-1, 0.0)  # (heartbeat number, when it ran), set by the loop
        self._stop = threading.Event()
        # (heartbeat number, the loop thread's run-queue ns and the collector's s before due)
        self._mark: tuple[int, int, float] = (-1, 0, 0.0)
        self._last: tuple[float, int, float] = (0.0, 0, 0.0)  # (last tick, run-queue ns, gc s)
        self._current: Stall | None = None
        self.thread: threading.Thread | None = None

    # ----- on the loop --------------------------------------------------------------------------

    def start(self) -> None:
        """Start watching the running loop; call it from a coroutine on that loop."""
        global _active
        self._loop = asyncio.get_running_loop()
        self._thread_id = threading.get_ident()
        self._native_id = threading.get_native_id()
        self._base = _base_frame(sys._getframe(1))
        self.gc.start()
        self._last = (time.monotonic(), _runqueue_ns(self._native_id), self.gc.total_s)
        self._beat()
        self.thread = threading.Thread(target=self._watch, name="modelyard-loop-monitor")
        self.thread.daemon = True
        self.thread.start()
        _active = self
        log.info("loop-stall monitor on: threshold %.0f ms", self.threshold_s * 1000)

    def stop(self) -> None:
        """Stop watching (from the loop or any thread); the watchdog exits within a tick."""
        global _active
        self._stop.set()
        self.gc.stop()
        if self._handle is not None:
            self._handle.cancel()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=5)
        if _active is self:
            _active = None

    def _beat(self) -> None:
        if self._stop.is_set() or self._loop is None:
            return
        now = time.monotonic()
        number = self._pending[0]
        self._ran = (number, now)
        self.beats += 1
        self._pending = (number + 1, now + self.interval_s)
        self._handle = self._loop.call_later(self.interval_s, self._beat)

    # ----- on the watchdog thread ---------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._tick()
            except Exception:  # the guard must never take its process down
                log.exception("loop-stall monitor: a check failed")

    def _tick(self) -> None:
        number, due = self._pending
        now = time.monotonic()
        work: list[_Where] | None = None
        others: list[list[_Where]] = []
        if now - due > self.threshold_s and self._current is None:
            # The stack first, before anything here gives up the GIL: work that held it (one
            # long C call) has just let go, and would run on to its end meanwhile.
            frames = sys._current_frames()
            if self.gc.collecting:
                return  # a collection is ending, its time not yet added: the next tick decides
            frame = frames.get(self._thread_id)
            work = self._work(frame) if frame is not None else None
            others = _running_threads(frames, self._thread_id) if work else []
        runqueue, collecting = _runqueue_ns(self._native_id), self.gc.total_s
        for pause in self.gc.drain():
            self._gc_pause(pause)
        if self._current is not None and self._ran[0] >= self._current.beat:
            self._ended(self._current, self._ran[1], runqueue, collecting)
            self._current = None
        if self._mark[0] != number:
            # The loop thread's run-queue and the collector's time from before the heartbeat was
            # due: the last tick's if it was (a starved loop thread delays the ticks too).
            before, queued, collected = self._last
            if before > due:
                queued, collected = runqueue, collecting
            self._mark = (number, queued, collected)
        self._last = (now, runqueue, collecting)
        overdue = now - due
        self.max_overdue_s = max(self.max_overdue_s, overdue)
        # Minus the time the loop thread was not run, and the time the collector held it.
        held = overdue - (runqueue - self._mark[1]) / 1e9 - (collecting - self._mark[2])
        if held > self.threshold_s and work:
            stall = Stall(
                held, _format(work), beat=number, others=[_format(x) for x in others],
                due=due, runqueue_mark=self._mark[1], gc_mark=self._mark[2],
            )  # fmt: skip
            self._current = stall
            self._found(stall)

    def _work(self, top: FrameType) -> list[_Where] | None:
        """Where the loop thread is (innermost first, the loop's own frames left out) if it is
        running work other than the heartbeat, else None (idle, or in the loop's own code)."""
        frames: list[FrameType] = []
        f: FrameType | None = top
        while f is not None and f is not self._base:
            frames.append(f)
            f = f.f_back
        if f is None:  # the loop is no longer running under the frame it started in
            return None
        own = self._beat.__code__
        work = [x for x in frames if not _is_machinery(x)]
        if all(x.f_code is own for x in work):
            return None
        return [(x.f_code.co_filename, x.f_lineno, x.f_code.co_name) for x in work]

    def _found(self, stall: Stall) -> None:
        self.count.inc()
        self.stalls = [*self.stalls[-99:], stall]
        others = "".join(
            "\nanother thread at that moment (not parked on a lock, queue or selector):\n"
            + "\n".join(x)
            for x in stall.others
        )
        log.warning(
            "event loop stalled: held for %.0f ms so far (threshold %.0f ms) by:\n%s%s",
            stall.stalled_s * 1000, self.threshold_s * 1000, "\n".join(stall.stack), others,
        )  # fmt: skip
        self._append({"event": "stall", "stalled_ms": round(stall.stalled_s * 1000, 1),
                      "stack": stall.stack, "other_threads": stall.others})  # fmt: skip

    def _gc_pause(self, pause: GcPause) -> None:
        self.gc_pauses.inc()
        log.warning(
            "garbage collection (generation %d, %d objects freed) held every thread for %.0f ms "
            "(threshold %.0f ms)",
            pause.generation, pause.collected, pause.seconds * 1000, self.threshold_s * 1000,
        )  # fmt: skip
        self._append({"event": "gc_pause", "generation": pause.generation,
                      "paused_ms": round(pause.seconds * 1000, 1)})  # fmt: skip

    def _ended(self, stall: Stall, ran: float, runqueue: int, collecting: float) -> None:
        not_work = (runqueue - stall.runqueue_mark) / 1e9 + collecting - stall.gc_mark
        duration = max(ran - stall.due - not_work, stall.stalled_s)
        stall.duration_s = duration
        self.seconds.observe(duration)
        log.warning("event loop stall ended after %.0f ms", duration * 1000)
        self._append({"event": "stall_end", "duration_ms": round(duration * 1000, 1)})

    def _append(self, record: dict[str, object]) -> None:
        if self.log_path is None:
            return
        line = {"ts": time.time(), "pid": os.getpid(), "process": " ".join(sys.argv[:3]),
                "threshold_ms": self.threshold_s * 1000, **record}  # fmt: skip
        data = (json.dumps(line) + "\n").encode()
        try:  # one write to an O_APPEND file: lines of several processes do not interleave
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("loop-stall log %s not written: %s", self.log_path, exc)


def _base_frame(caller: FrameType) -> FrameType:
    """The frame the loop runs under (e.g. `asyncio.Runner.run`): below the outermost coroutine
    frame of the running task and below the loop's own Python frames."""
    entry = caller
    f: FrameType | None = caller
    while f is not None:
        if f.f_code.co_flags & _COROUTINE_FLAGS:
            entry = f
        f = f.f_back
    base = entry.f_back
    while base is not None and _is_machinery(base):
        base = base.f_back
    if base is None:
        raise RuntimeError("the loop monitor must be started from code running on the loop")
    return base


_active: LoopMonitor | None = None


def loop_stall_families() -> list[Metric]:
    """This process's stall series (none while no monitor runs)."""
    monitor = _active
    return list(monitor.registry.collect()) if monitor is not None else []


class LoopStallCollector(Collector):
    """The stall series for a process's own `CollectorRegistry`."""

    def collect(self) -> Iterator[Metric]:
        yield from loop_stall_families()


@contextlib.contextmanager
def watching_loop(settings: TelemetrySettings | None = None) -> Iterator[LoopMonitor | None]:
    """Around a process's serving (its app's lifespan): the monitor, if `loop_stall_ms` > 0."""
    settings = settings or TelemetrySettings()
    if not settings.loop_stall_ms:
        yield None
        return
    monitor = LoopMonitor(settings.loop_stall_ms / 1000, settings.loop_stall_log)
    monitor.start()
    try:
        yield monitor
    finally:
        monitor.stop()
