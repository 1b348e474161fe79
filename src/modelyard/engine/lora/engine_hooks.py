"""What `LLMEngine` asks of LoRA, kept here so the engine's own change stays a few calls."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import deque
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

from modelyard.engine.lora.adapter import AdapterError
from modelyard.engine.lora.manager import LoRAManager
from modelyard.engine.model_runner import ModelRunner
from modelyard.engine.request_checks import RequestRejected
from modelyard.engine.requests import EngineRequest


def _no_lora(name: str) -> RequestRejected:
    return RequestRejected(
        f"model names adapter {name!r}, but this engine serves no LoRA adapters (max_loras is 0)",
        param="model",
        code="model_not_found",
    )


def adapter_namespace(runner: ModelRunner, name: str) -> bytes:
    """The prefix-cache namespace of adapter `name` (its name and weights fingerprint), so no
    two adapters share cached blocks; `RequestRejected` naming `model` if it cannot be served."""
    if runner.lora is None:
        raise _no_lora(name)
    try:
        return runner.lora.namespace(name).encode("utf-8")
    except AdapterError as exc:
        raise RequestRejected(str(exc), param="model", code="model_not_found") from exc


class AdapterWaitlist:
    """Requests whose adapter waits for a slot: every slot holds an adapter of a running request.
    They are in the engine (abortable, counted as waiting) but reach the scheduler only once a
    slot is theirs, first come first served; a finishing holder frees its slot for the next."""

    def __init__(self) -> None:
        self._queue: deque[tuple[EngineRequest, str]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def hold(
        self, runner: ModelRunner, req: EngineRequest, name: str, live: Collection[str]
    ) -> bool:
        """True if `req` holds `name`'s slot now (schedule it); else it waits here. While any
        request waits, later ones queue behind it even if their adapter is loaded: joining a
        held slot would keep it held, and the waiting one could starve."""
        assert runner.lora is not None  # adapter_namespace passed
        if not self._queue and runner.lora.try_acquire(req.request_id, name, live):
            return True
        self._queue.append((req, name))
        return False

    def admit(self, runner: ModelRunner, live: Collection[str]) -> list[EngineRequest]:
        """The waiting requests that got their slot now, in arrival order (aborted ones drop)."""
        admitted: list[EngineRequest] = []
        assert runner.lora is not None
        while self._queue:
            req, name = self._queue[0]
            if req.request_id not in live:
                self._queue.popleft()
                continue
            if not runner.lora.try_acquire(req.request_id, name, live):
                break
            self._queue.popleft()
            admitted.append(req)
        return admitted


def check_adapter(runner: ModelRunner, name: str) -> None:
    """At the API edge: `RequestRejected` (naming `model`) unless this engine serves LoRA and
    `name` resolves to an adapter folder (its weights are checked when it is loaded)."""
    if runner.lora is None:
        raise _no_lora(name)
    try:
        runner.lora.resolve(name)
    except AdapterError as exc:
        raise RequestRejected(str(exc), param="model", code="model_not_found") from exc


class AdapterReads:
    """The worker's edge reads a request's adapter from disk and checks it (`LoRAManager.read`)
    on a thread of its own before the request enters the engine, so the engine's loop only
    copies it into a slot: read there, 50 tenants' first requests held every stream in the
    engine without a token for all 50 reads (2.2 s on an idle 2 vCPU, past
    `no_progress_timeout_s` on a loaded one)."""

    def __init__(self) -> None:
        self._thread: ThreadPoolExecutor | None = None  # made on the first LoRA request

    async def read(self, lora: LoRAManager | None, name: str) -> None:
        """Read adapter `name` unless it is in a slot. A read that fails is left to the engine,
        which reads it again and fails the request as it always did."""
        if lora is None or lora.in_slot(name):
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, "modelyard-lora-read")
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            await loop.run_in_executor(self._thread, context.run, lora.read, name)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
