"""`ModelHost`: several small encoders in one process within a memory budget.

Models are registered by name and loaded on first use. Loading one that would overflow the
budget first evicts the least recently used idle models (idle: no request holds it); a model
larger than the whole budget is refused, and so is a load that only busy models stand in the
way of (`HostBusy`: retry later). Each loaded model has its own `DynamicBatcher`.

Requests hold a model with `async with host.use(name)`, which loads it (in a worker thread) if
need be and keeps it from being evicted until the request is done. Concurrent first uses of one
model load it once; loads of different models run side by side, their memory reserved up front
from an estimate read off their files, then settled at the loaded size.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelyard.encoders.batcher import DynamicBatcher
from modelyard.encoders.errors import HostBusy, ModelTooLarge, UnknownModel, UnsupportedModel
from modelyard.encoders.loading import (
    MODEL_KINDS,
    Encoder,
    ModelKind,
    batch_function,
    detect_kind,
    estimate_bytes,
    load_encoder,
)

# Told the model's name, the batch size and its seconds, for every batch any model runs.
HostBatchListener = Callable[[str, int, float], None]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: ModelKind
    path: Path
    estimate: int  # bytes once loaded, from the recorded parameter count (never its headers)


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: Encoder
    batcher: DynamicBatcher[Any, Any]
    memory: int
    last_used: float = field(default_factory=time.monotonic)
    leases: int = 0

    @property
    def idle(self) -> bool:
        return self.leases == 0 and self.batcher.pending == 0


@dataclass
class ModelStatus:
    name: str
    kind: ModelKind
    loaded: bool
    memory_bytes: int


class ModelHost:
    def __init__(
        self,
        memory_budget: int,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        device: str = "cpu",
    ) -> None:
        if memory_budget <= 0:
            raise ValueError("memory_budget must be positive")
        self.memory_budget = memory_budget
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self.device = device
        self.evictions = 0
        self._specs: dict[str, ModelSpec] = {}
        self._loaded: dict[str, LoadedModel] = {}
        self._reserved = 0  # bytes promised to loads under way
        self._lock = threading.Lock()  # guards the three above; never held while loading
        self._load_locks: dict[str, threading.Lock] = {}
        self._listeners: list[HostBatchListener] = []

    # ----- registry ----------------------------------------------------------------------------

    def register(
        self, name: str, path: str | Path, kind: ModelKind | None = None, *, param_count: int
    ) -> ModelSpec:
        """Add a model (not loaded yet); `kind` defaults to what the folder looks like;
        `param_count` is the figure recorded when its files were checked (the host never
        reads a weights header)."""
        folder = Path(path)
        kind = kind or detect_kind(folder)
        if kind not in MODEL_KINDS:
            raise UnsupportedModel(f"unknown model kind {kind!r} (one of {', '.join(MODEL_KINDS)})")
        spec = ModelSpec(name, kind, folder, estimate_bytes(kind, folder, param_count))
        # Refused now rather than on every request: its files alone overflow the budget.
        self._check_fits(spec, spec.estimate)
        with self._lock:
            self._specs[name] = spec
            self._load_locks.setdefault(name, threading.Lock())
        return spec

    def unregister(self, name: str) -> bool:
        """Forget a model (unloading it); False if it is unknown or busy right now."""
        with self._lock:
            if name not in self._specs:
                return False
            model = self._loaded.get(name)
            if model is not None:
                if not model.idle:
                    return False
                self._drop(name)
            del self._specs[name]
            return True

    @property
    def names(self) -> list[str]:
        return list(self._specs)

    def spec(self, name: str) -> ModelSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownModel(name) from None

    def loaded(self, name: str) -> LoadedModel | None:
        return self._loaded.get(name)

    @property
    def memory_used(self) -> int:
        with self._lock:
            return sum(m.memory for m in self._loaded.values())

    def status(self) -> list[ModelStatus]:
        with self._lock:
            return [
                ModelStatus(
                    s.name,
                    s.kind,
                    s.name in self._loaded,
                    self._loaded[s.name].memory if s.name in self._loaded else 0,
                )
                for s in self._specs.values()
            ]

    def add_batch_listener(self, listener: HostBatchListener) -> None:
        self._listeners.append(listener)

    # ----- use ---------------------------------------------------------------------------------

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[LoadedModel]:
        """Hold `name` (loading it first if need be) for the duration of the block."""
        loaded = self._lease_if_loaded(name)
        if loaded is None:
            pending = asyncio.get_running_loop().run_in_executor(None, self._load_leased, name)
            try:
                loaded = await asyncio.shield(pending)
            except asyncio.CancelledError:
                # The load goes on in its thread; give back the lease it will take.
                pending.add_done_callback(self._release_when_loaded)
                raise
        try:
            yield loaded
        finally:
            self.release(loaded)

    def load(self, name: str) -> LoadedModel:
        """Load `name` now if it is not loaded (blocking); evicts idle models to make room."""
        loaded = self._load_leased(name)
        self.release(loaded)
        return loaded

    def release(self, loaded: LoadedModel) -> None:
        with self._lock:
            loaded.leases -= 1
            loaded.last_used = time.monotonic()

    def evict(self, name: str) -> bool:
        """Unload `name` if it is loaded and idle."""
        with self._lock:
            model = self._loaded.get(name)
            if model is None or not model.idle:
                return False
            self._drop(name)
            return True

    def close(self) -> None:
        with self._lock:
            for name in list(self._loaded):
                self._drop(name)

    # ----- internals ---------------------------------------------------------------------------

    def _lease_if_loaded(self, name: str) -> LoadedModel | None:
        self.spec(name)
        with self._lock:
            loaded = self._loaded.get(name)
            if loaded is not None:
                loaded.leases += 1
                loaded.last_used = time.monotonic()
            return loaded

    def _release_when_loaded(self, pending: asyncio.Future[LoadedModel]) -> None:
        if not pending.cancelled() and pending.exception() is None:
            self.release(pending.result())

    def _load_leased(self, name: str) -> LoadedModel:
        spec = self.spec(name)
        with self._load_locks[name]:  # one load per model; the others wait and find it loaded
            loaded = self._lease_if_loaded(name)
            if loaded is not None:
                return loaded
            evictions = self.evictions
            estimate = spec.estimate
            self._check_fits(spec, estimate)
            with self._lock:
                self._make_room(spec, estimate)
                self._reserved += estimate
            try:
                model = load_encoder(spec.kind, spec.path, self.device)
            finally:
                with self._lock:
                    self._reserved -= estimate
            memory = model.memory_bytes()
            self._check_fits(spec, memory)
            batcher: DynamicBatcher[Any, Any] = DynamicBatcher(
                batch_function(model),
                max_batch_size=self.max_batch_size,
                max_wait_ms=self.max_wait_ms,
                on_batch=self._batch_listener(name),
            )
            loaded = LoadedModel(spec, model, batcher, memory, leases=1)
            with self._lock:
                self._make_room(spec, memory)
                self._loaded[name] = loaded
            if self.evictions != evictions:
                gc.collect()  # what the evicted models held goes back now, not at some later GC
            return loaded

    def _check_fits(self, spec: ModelSpec, size: int) -> None:
        if size > self.memory_budget:
            raise ModelTooLarge(
                f"model '{spec.name}' needs {size} bytes, more than the whole memory budget of "
                f"{self.memory_budget} bytes"
            )

    def _make_room(self, spec: ModelSpec, size: int) -> None:
        """Evict least recently used idle models until `size` more bytes fit. Holds the lock."""
        used = sum(m.memory for m in self._loaded.values()) + self._reserved
        if used + size <= self.memory_budget:
            return
        idle = sorted((m for m in self._loaded.values() if m.idle), key=lambda m: m.last_used)
        victims = []
        for model in idle:
            if used + size <= self.memory_budget:
                break
            victims.append(model.spec.name)
            used -= model.memory
        if used + size > self.memory_budget:
            raise HostBusy(
                f"model '{spec.name}' needs {size} bytes and the models in use hold too much of "
                f"the {self.memory_budget}-byte memory budget; retry later"
            )
        for name in victims:
            self._drop(name)

    def _drop(self, name: str) -> None:
        loaded = self._loaded.pop(name)
        loaded.batcher.close()
        self.evictions += 1

    def _batch_listener(self, name: str) -> Callable[[int, float], None]:
        def tell(size: int, seconds: float) -> None:
            for listener in self._listeners:
                listener(name, size, seconds)

        return tell
