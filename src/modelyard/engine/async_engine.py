"""`AsyncEngine`: one background thread owns the `LLMEngine`; each request gets an async stream.

Requests and aborts enter through a thread-safe inbox that the loop drains before every step;
outputs go back to each request's asyncio queue on the caller's event loop. Leaving the stream
early (client disconnect, timeout) aborts the request and frees its blocks at the next step.

Requests are checked by the caller (`LLMEngine.check_request`) before `generate`. A request
that fails in a step gets `RequestFailed` and the loop goes on; a fatal error, or
`MAX_CONSECUTIVE_FAILED_STEPS` steps in a row in which every request failed, stops the loop,
fails every stream with `EngineDeadError` and calls `on_fatal` (the worker exits on it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from modelyard.engine.faults import MAX_CONSECUTIVE_FAILED_STEPS, RequestInvalid, is_fatal
from modelyard.engine.llm_engine import LLMEngine, RequestOutput
from modelyard.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class RequestTimeout(TimeoutError):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class EngineDeadError(RuntimeError):
    """The engine loop failed; requests in flight were failed with it."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: float
    cache_salt: str | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        request_timeout_s: float = 120.0,
        no_progress_timeout_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.request_timeout_s = request_timeout_s
        self.no_progress_timeout_s = no_progress_timeout_s
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None  # set once the loop has stopped for good
        self.consecutive_failed_steps = 0
        # Called from the engine thread with the reason, once, when the engine dies.
        self.on_fatal: Callable[[str], None] | None = None

    # ----- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop, then the engine's helper ranks (tensor parallelism), if any."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.engine.close()

    @property
    def healthy(self) -> bool:
        return (
            self.error is None
            and self.engine.failure is None
            and self._thread is not None
            and self._thread.is_alive()
        )

    # ----- the loop (engine thread) ----------------------------------------------------------

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Add):
                try:
                    self.engine.add_request(
                        item.request_id,
                        item.prompt_token_ids,
                        item.params,
                        item.priority,
                        item.arrival,
                        item.cache_salt,
                    )
                except Exception as exc:  # checked before queuing; only a race ends here
                    self._deliver(item.request_id, exc)
            elif isinstance(item, _Abort):
                self.engine.abort_request(item.request_id)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self.engine.interrupt.clear()  # what is queued by now is in the next plan
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as exc:
            self._die(exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            if is_fatal(exc) or self.engine.failure is not None:
                raise
            # Not the fault of a known request (e.g. the scheduler): fail them all, go on.
            log.exception("engine step failed; failing the requests in flight")
            outputs = self.engine.fail_all(exc)
        # A request its own grammar failed says nothing of the engine: not counted.
        failed = sum(
            out.error is not None and not isinstance(out.error, RequestInvalid) for out in outputs
        )
        if failed and failed == len(outputs):
            self.consecutive_failed_steps += 1
            if self.consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                raise RuntimeError(
                    f"{self.consecutive_failed_steps} engine steps in a row failed every request"
                )
        elif outputs:
            self.consecutive_failed_steps = 0
        for out in outputs:
            self._deliver(out.request_id, out.error or out)

    def _die(self, exc: BaseException) -> None:
        """The loop stops for good: fail every stream, then tell the owner (the worker exits)."""
        log.error("engine failed and stops: %r", exc, exc_info=exc)
        self.error = exc
        self._fail_all(EngineDeadError(f"engine step failed: {exc}"))
        if self.on_fatal is not None:
            self.on_fatal(str(exc))

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine is dead anyway; the stream must still hear of it
                log.exception("abort of %s failed", request_id)
            self._deliver(request_id, exc)

    # ----- the API (event loop) --------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput]:
        """Stream the request's outputs. The request must have passed
        `LLMEngine.check_request`; if it fails in a step this raises `RequestFailed`.
        `cache_salt` is its prefix-cache namespace (see `LLMEngine.add_request`)."""
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error or self.engine.failure}")
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
        start = time.monotonic()
        self._inbox.put(_Add(request_id, prompt_token_ids, params, priority, start, cache_salt))
        self.engine.urgent(priority)  # a step of batch alone in flight stops for it
        # Logged in the caller's context: the worker's request id rides on these lines.
        log.debug(
            "request %s queued: %d prompt tokens, priority %d",
            request_id, len(prompt_token_ids), priority,
        )  # fmt: skip
        finished = False
        try:
            while True:
                remaining = start + self.request_timeout_s - time.monotonic()
                wait = min(self.no_progress_timeout_s, remaining)
                try:
                    item = await asyncio.wait_for(stream.queue.get(), timeout=max(wait, 0.0))
                except TimeoutError:
                    if remaining <= self.no_progress_timeout_s:
                        raise RequestTimeout(
                            f"request exceeded the server timeout of {self.request_timeout_s:g}s",
                            "request_timeout",
                        ) from None
                    raise RequestTimeout(
                        f"no progress for {self.no_progress_timeout_s:g}s", "no_progress_timeout"
                    ) from None
                if isinstance(item, BaseException):
                    finished = True  # failed requests are already out of the engine
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)
            log.debug(
                "request %s %s after %.1f ms", request_id, "ended" if finished else "aborted",
                (time.monotonic() - start) * 1000,
            )  # fmt: skip
