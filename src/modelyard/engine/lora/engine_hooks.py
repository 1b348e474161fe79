"""What `LLMEngine` asks of LoRA, kept here so the engine's own change stays a few calls."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from modelyard.engine.lora.adapter import AdapterError
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
        if not self._queue:
            runner.lora.forget_staged()
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
