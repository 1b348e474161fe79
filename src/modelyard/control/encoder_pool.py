"""The shared encoder host: one process that serves every embedding and classifier endpoint.

Small models share a device instead of taking a process each: an encoder endpoint is a model
registered in this host (under its endpoint id, so equal names of two tenants never meet),
loaded on first use and evicted least-recently-used within `encoder_host_memory`. The host takes
that budget (plus the per-process overhead) on one device through `Placement`, like any replica,
and gives it back when it stops. The pool starts the host on first need, re-registers every
model if the host has to be restarted, and keeps each endpoint's route pointed at the host's
current address. In a cluster, a new leader's pool adopts the host its predecessor left running
(`adopt`, from the routing entries; `control/takeover.py`) instead of starting another, so
embeddings keep answering through a takeover.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx

from modelyard.config import PlatformSettings
from modelyard.control.backends.base import (
    Backend,
    ReplicaHandle,
    ReplicaSpec,
    ReplicaStartError,
    wait_healthy,
)
from modelyard.control.devices import pinning_env
from modelyard.control.placement import Placement, ReplicaRequest
from modelyard.core.cluster_auth import replica_headers
from modelyard.core.routing import ReplicaRoute, RoutingTable
from modelyard.store import repository as repo

log = logging.getLogger(__name__)


class EncoderHostError(RuntimeError):
    pass


@dataclass
class _Model:
    path: Path
    param_count: int  # recorded at push: the host sizes the model from it, not its files
    routes: list[ReplicaRoute] = field(default_factory=list)


class EncoderPool:
    def __init__(
        self,
        settings: PlatformSettings,
        backend: Backend,
        placement: Placement,
        routing: RoutingTable,
    ) -> None:
        self.settings = settings
        self.routing = routing
        self.backend = backend
        self.placement = placement
        self.handle: ReplicaHandle | None = None
        self.placement_id: str | None = None
        self.devices: list[str] = []
        self.started_at: float | None = None
        self.restarts = 0
        self._models: dict[str, _Model] = {}
        self._lock = asyncio.Lock()
        self._http = httpx.AsyncClient(timeout=30.0, headers=replica_headers(settings))

    @property
    def url(self) -> str | None:
        return self.handle.url if self.handle else None

    def alive(self) -> bool:
        return self.handle is not None and self.backend.alive(self.handle)

    def _place(self, replica_id: str) -> dict[str, str]:
        """Reserve the host's memory on a device; returns the env that pins it there."""
        s = self.settings
        need = s.encoder_host_memory + s.replica_overhead_bytes
        result = self.placement.place([ReplicaRequest(replica_id, "encoder-host", need)])
        if replica_id in result.unschedulable:
            why = result.unschedulable[replica_id]
            raise EncoderHostError(f"encoder host unschedulable: {why}")
        self.placement_id = replica_id
        devices = result.assignments[replica_id]
        self.devices = [d.qualified_name for d in devices]
        return pinning_env(devices)

    def _release(self) -> None:
        if self.placement_id is not None:
            self.placement.release(self.placement_id)
            self.placement_id = None
            self.devices = []

    async def _stop(self) -> None:
        if self.handle is not None:
            await self.backend.stop(self.handle)
        self.handle = None
        self._release()

    def _spec(self, replica_id: str, env: dict[str, str]) -> ReplicaSpec:
        s = self.settings
        return ReplicaSpec(
            replica_id=replica_id,
            endpoint_id="encoder-host",
            model_path=None,
            served_model_name="",
            command="encoders",
            args=(
                "--memory-budget", str(s.encoder_host_memory),
                "--max-batch-size", str(s.encoder_max_batch_size),
                "--max-wait-ms", str(s.encoder_max_wait_ms),
            ),
            engine_env=env,
        )  # fmt: skip

    async def adopt(self, url: str, pid: int | None, host_id: str | None) -> bool:
        """A host the previous leader left running (at `url`, as `pid`; the backend's replica
        `host_id`) is this pool's from now on, if it answers and its memory fits here: its
        models are registered again by their endpoints, on the same address. True if the pool
        serves from that host (adopted now or already); False: the caller stops it."""
        async with self._lock:
            if self.handle is not None:
                return self.handle.url == url  # another endpoint's record adopted it already
            spec = self._spec(host_id or repo.new_id("enc"), {})
            handle = await self.backend.adopt(spec, url, pid)
            try:
                ok = self.backend.alive(handle)
                ok = ok and (await self._http.get(url + "/health")).status_code == 200
                if ok:
                    self._place(spec.replica_id)
            except (httpx.HTTPError, EncoderHostError) as exc:
                log.warning("the running encoder host is not adopted: %s", exc)
                ok = False
            if not ok:
                await self.backend.stop(handle, 5.0)
                return False
            self.handle, self.started_at = handle, time.time()
            log.info("adopted the running encoder host at %s (pid %s)", url, pid)
            return True

    async def _start(self) -> None:
        s = self.settings
        replica_id = repo.new_id("enc")
        env = self._place(replica_id)
        spec = self._spec(replica_id, env)
        try:
            self.handle = await self.backend.start(spec)
            self.started_at = time.time()
            await wait_healthy(self.backend, self.handle, self._http, s.replica_start_timeout_s)
        except ReplicaStartError as exc:
            await self._stop()
            raise EncoderHostError(f"encoder host: {exc}") from exc
        except BaseException:
            await self._stop()
            raise

    async def _put(self, name: str, path: Path, param_count: int) -> None:
        assert self.handle is not None
        body = {"path": str(path), "param_count": param_count}
        r = await self._http.put(
            f"{self.handle.url}/admin/models/{quote(name, safe='')}", json=body
        )
        if r.status_code != 200:
            raise EncoderHostError(f"the encoder host refused {name}: {r.text[:300]}")

    async def ensure(self) -> None:
        """Start (or restart) the host if it is not running, with every model registered."""
        async with self._lock:
            if self.alive():
                return
            if self.handle is not None:
                self.restarts += 1
                log.warning("encoder host died; restarting it with %d models", len(self._models))
            await self._stop()
            await self._start()
            for name, model in self._models.items():
                await self._put(name, model.path, model.param_count)
                for route in model.routes:
                    self.routing.readmit(route, url=self.handle.url)  # type: ignore[union-attr]

    async def register(self, name: str, path: Path, param_count: int) -> ReplicaRoute:
        """Serve `path` under `name` (sized from its recorded `param_count`); returns a route
        for the endpoint's routing entry."""
        await self.ensure()
        async with self._lock:
            assert self.handle is not None
            await self._put(name, path, param_count)
            route = ReplicaRoute(f"encoder-host/{name}", self.handle.url)
            self._models[name] = _Model(path, param_count, [route])
            return route

    async def unregister(self, name: str) -> None:
        async with self._lock:
            model = self._models.pop(name, None)
            if model is None or not self.alive():
                return
            assert self.handle is not None
            await self._http.delete(f"{self.handle.url}/admin/models/{quote(name, safe='')}")
            if not self._models:  # nothing left to serve: give the memory back
                await self._stop()

    async def healthy(self) -> bool:
        if not self.alive():
            return False
        assert self.handle is not None
        try:
            return (await self._http.get(self.handle.url + "/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def close(self) -> None:
        await self._http.aclose()
