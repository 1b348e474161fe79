"""`DynamicBatcher`: callers submit one item each and await its result; items that arrive within a
short window run together as one call of a synchronous batch function, in a worker thread so the
event loop stays free.

A batch starts when it is full (`max_batch_size`) or when its oldest item has waited
`max_wait_ms`; items that queued up while the previous batch ran have already waited, so they go
at once. One batch runs at a time per batcher: the batch function is a model's forward pass, and
two of those at once only fight over the same cores.

Failures stay with their own item: if the batch function raises, each item is run again alone and
gets its own result or exception. A caller cancelled before its batch runs drops out of it; one
cancelled while it runs simply gets nothing delivered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

BatchFunction = Callable[[list[T]], list[R]]
# Told the size and the wall-clock seconds of every batch run (for metrics).
BatchListener = Callable[[int, float], None]


@dataclass
class BatcherStats:
    batches: int = 0
    items: int = 0
    fallbacks: int = 0  # batches that failed whole and were re-run item by item

    @property
    def mean_batch_size(self) -> float:
        return self.items / self.batches if self.batches else 0.0


@dataclass
class _Entry(Generic[T, R]):
    item: T
    future: asyncio.Future[R]
    arrival: float


@dataclass
class _Outcome(Generic[R]):
    result: R | None = None
    error: BaseException | None = None


class BatcherClosed(RuntimeError):
    pass


class DynamicBatcher(Generic[T, R]):
    def __init__(
        self,
        fn: BatchFunction[T, R],
        *,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        executor: Executor | None = None,
        on_batch: BatchListener | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.fn = fn
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.executor = executor
        self.on_batch = on_batch
        self.stats = BatcherStats()
        self._running = 0
        # Bound to the event loop of the first submit (the batcher may be built in a thread).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._queue: deque[_Entry[T, R]] = deque()
        self._wakeup: asyncio.Event | None = None

    @property
    def pending(self) -> int:
        """Items queued or running."""
        return len(self._queue) + self._running

    async def submit(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        self._ensure_started(loop)
        assert self._wakeup is not None
        future: asyncio.Future[R] = loop.create_future()
        self._queue.append(_Entry(item, future, loop.time()))
        self._wakeup.set()
        # Cancelling this caller cancels `future`, which is how the loop knows to skip it.
        return await future

    def close(self) -> None:
        """Stop the batching task; items still queued fail with `BatcherClosed`. Safe to call
        from any thread."""
        task, loop = self._task, self._loop
        self._task = None
        if task is None or task.done() or loop is None or loop.is_closed():
            return
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is loop:
            task.cancel()
        else:
            loop.call_soon_threadsafe(task.cancel)

    def _ensure_started(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        # A new loop (tests run one per test) cannot use futures of a closed one: start afresh.
        self._loop = loop
        self._queue = deque()
        self._wakeup = asyncio.Event()
        self._task = loop.create_task(self._run_forever(self._queue, self._wakeup))

    async def _run_forever(self, queue: deque[_Entry[T, R]], wakeup: asyncio.Event) -> None:
        try:
            while True:
                batch = await self._collect(queue, wakeup)
                live = [e for e in batch if not e.future.done()]
                if not live:
                    continue
                try:
                    await self._run(live)
                except Exception as exc:  # a bug here must not strand the callers
                    log.exception("batch delivery failed")
                    for entry in live:
                        if not entry.future.done():
                            entry.future.set_exception(exc)
        except asyncio.CancelledError:
            while queue:
                entry = queue.popleft()
                if not entry.future.done():
                    entry.future.set_exception(BatcherClosed("the model was unloaded"))
            raise

    async def _collect(
        self, queue: deque[_Entry[T, R]], wakeup: asyncio.Event
    ) -> list[_Entry[T, R]]:
        loop = asyncio.get_running_loop()
        while not queue:
            wakeup.clear()
            await wakeup.wait()
        deadline = queue[0].arrival + self.max_wait_s
        while len(queue) < self.max_batch_size:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            wakeup.clear()
            try:
                await asyncio.wait_for(wakeup.wait(), remaining)
            except TimeoutError:
                break
        return [queue.popleft() for _ in range(min(len(queue), self.max_batch_size))]

    async def _run(self, entries: list[_Entry[T, R]]) -> None:
        loop = asyncio.get_running_loop()
        items = [e.item for e in entries]
        self._running = len(entries)
        start = time.perf_counter()
        try:
            outcomes = await loop.run_in_executor(self.executor, self._call, items)
        except Exception as exc:  # the executor itself failed: nothing ran
            outcomes = [_Outcome(error=exc) for _ in items]
        finally:
            self._running = 0
        seconds = time.perf_counter() - start
        self.stats.batches += 1
        self.stats.items += len(items)
        for entry, outcome in zip(entries, outcomes, strict=True):
            if entry.future.done():
                continue
            if outcome.error is not None:
                entry.future.set_exception(outcome.error)
            else:
                entry.future.set_result(outcome.result)  # type: ignore[arg-type]
        if self.on_batch is not None:
            try:
                self.on_batch(len(items), seconds)
            except Exception:
                log.exception("batch listener failed")

    def _call(self, items: list[T]) -> list[_Outcome[R]]:
        """Runs in the worker thread: the whole batch, else each item alone."""
        try:
            return [_Outcome(result=r) for r in self._checked(items)]
        except Exception as exc:
            if len(items) == 1:
                return [_Outcome(error=exc)]
        self.stats.fallbacks += 1
        outcomes: list[_Outcome[R]] = []
        for item in items:
            try:
                outcomes.append(_Outcome(result=self._checked([item])[0]))
            except Exception as exc:
                outcomes.append(_Outcome(error=exc))
        return outcomes

    def _checked(self, items: list[T]) -> list[R]:
        results = self.fn(items)
        if len(results) != len(items):
            raise RuntimeError(f"batch function gave {len(results)} results for {len(items)} items")
        return list(results)
