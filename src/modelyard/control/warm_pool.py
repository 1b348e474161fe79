"""The warm pool: idle replicas of popular base models, already loaded, for cold endpoints.

`warm_pool` names registry models of the platform admin and how many idle replicas of each to
keep. An endpoint that needs a replica of the same base version takes one over in milliseconds
(the worker is told its new public name) instead of loading for seconds; the pool starts a
replacement in the background. The same base version: the pool's version itself, or any
tenant's version made of the very same files (a tenant that pushed the same model); and its
engine settings must come to the pool's (overrides that repeat a default are no difference).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx

from modelyard.config import EngineSettings, PlatformSettings
from modelyard.control.backends.base import Backend, ReplicaHandle, ReplicaSpec, wait_healthy
from modelyard.control.devices import pinning_env
from modelyard.control.node_cache import NodeCache
from modelyard.control.placement import Placement, ReplicaRequest
from modelyard.control.registry import Registry, ResolvedVersion
from modelyard.control.sizing import replica_bytes_per_device
from modelyard.core.cluster_auth import replica_headers
from modelyard.store import repository as repo

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    version: ResolvedVersion
    size: int
    idle: list[ReplicaHandle] = field(default_factory=list)  # each placed under its replica id
    starting: int = 0


class WarmPool:
    def __init__(
        self,
        settings: PlatformSettings,
        backend: Backend,
        registry: Registry,
        node_cache: NodeCache,
        engine_env: dict[str, str],
        placement: Placement,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.registry = registry
        self.node_cache = node_cache
        self.engine_env = engine_env
        self.placement = placement
        self._slots: dict[str, _Slot] = {}  # by version id
        self._http = httpx.AsyncClient(timeout=5.0, headers=replica_headers(settings))
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: dict[str, int] = {}  # refs not found in the registry yet
        self._tenant_id = ""
        self.taken = 0

    async def start(self, tenant_id: str) -> None:
        self._tenant_id = tenant_id
        self._pending = dict(self.settings.warm_pool)
        await self.tick()

    async def tick(self) -> None:
        """Resolve the models not in the registry yet (they may be pushed later) and refill."""
        for ref, size in list(self._pending.items()):
            version = await asyncio.to_thread(self.registry.resolve, self._tenant_id, ref, True)
            if version is not None:
                del self._pending[ref]
                self._slots[version.version_id] = _Slot(version, size)
        for version_id in self._slots:
            self._refill(version_id)

    def _refill(self, version_id: str) -> None:
        slot = self._slots[version_id]
        for _ in range(slot.size - len(slot.idle) - slot.starting):
            slot.starting += 1
            task = asyncio.create_task(self._start_one(slot))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _start_one(self, slot: _Slot) -> None:
        replica_id = repo.new_id("warm")
        try:
            entry = await asyncio.to_thread(self.node_cache.fetch, slot.version)
            params = slot.version.param_count
            if params is None:  # pushed before it was recorded: computed once, in a thread
                params = await asyncio.to_thread(self.registry.param_count, slot.version.version_id)
            need = replica_bytes_per_device(
                params,
                EngineSettings(**self.settings.worker_engine),
                on_cuda=any(d.kind == "cuda" for d in self.placement.devices),
                overhead=self.settings.replica_overhead_bytes,
            )
            result = self.placement.place([ReplicaRequest(replica_id, "warm-pool", need)])
            if replica_id in result.unschedulable:
                log.warning("warm pool: no room for %s: %s", slot.version.model_name,
                            result.unschedulable[replica_id])  # fmt: skip
                return
            spec = ReplicaSpec(
                replica_id=replica_id,
                endpoint_id="warm-pool",
                model_path=entry.path,
                served_model_name=f"warm-{slot.version.model_name}",
                engine_env={**self.engine_env, **pinning_env(result.assignments[replica_id])},
            )
            handle = None
            try:
                handle = await self.backend.start(spec)
                await wait_healthy(
                    self.backend, handle, self._http, self.settings.replica_start_timeout_s
                )
            except Exception:
                if handle is not None:
                    await self.backend.stop(handle)
                self.placement.release(replica_id)
                raise
            slot.idle.append(handle)
            log.info("warm pool: %s ready (%d idle)", slot.version.model_name, len(slot.idle))
        except Exception as exc:
            log.warning("warm pool: starting a %s replica failed: %s", slot.version.model_name, exc)
        finally:
            slot.starting -= 1

    async def take(
        self, version_id: str | None, served_name: str, engine_env: dict[str, str] | None = None
    ) -> tuple[ReplicaHandle, str] | None:
        """An idle loaded replica of this base version (see the module's docstring) whose
        engine settings match `engine_env` (the endpoint's overrides), renamed for its endpoint,
        with its placement id; None if there is none."""
        if version_id is None or not self._slots or not self.same_engine(engine_env or {}):
            return None
        slot = await self._slot_for(version_id)
        while slot is not None and slot.idle:
            handle = slot.idle.pop(0)
            self._refill(slot.version.version_id)
            if not self.backend.alive(handle):
                self.placement.release(handle.spec.replica_id)
                continue
            try:
                r = await self._http.put(
                    handle.url + "/admin/served-model", json={"name": served_name}
                )
            except httpx.HTTPError:
                r = None
            if r is None or r.status_code != 200:
                await self.backend.stop(handle)
                self.placement.release(handle.spec.replica_id)
                continue
            self.taken += 1
            return handle, handle.spec.replica_id
        return None

    async def _slot_for(self, version_id: str) -> _Slot | None:
        slot = self._slots.get(version_id)
        if slot is not None:
            return slot
        try:
            version = await asyncio.to_thread(self.registry.by_id, version_id)
        except Exception:
            return None
        for slot in self._slots.values():
            if slot.version.files == version.files and slot.version.format == version.format:
                return slot
        return None

    def same_engine(self, overrides: dict[str, str]) -> bool:
        """Whether a worker with the pool's engine settings under `overrides` (worker env vars)
        runs exactly as the pool's own workers do."""
        if not overrides:
            return True
        mine = _effective(self.engine_env)
        return mine is not None and _effective({**self.engine_env, **overrides}) == mine

    def idle(self) -> dict[str, int]:
        return {s.version.model_name: len(s.idle) for s in self._slots.values()}

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.aclose()


def _effective(env: dict[str, str]) -> EngineSettings | None:
    """The engine settings a worker given `env` runs with (None: not comparable)."""
    fields: dict[str, Any] = {
        key.removeprefix("MODELYARD_").lower(): value
        for key, value in env.items()
        if key.removeprefix("MODELYARD_").lower() in EngineSettings.model_fields
    }
    try:
        return EngineSettings(**fields)
    except Exception:
        return None
