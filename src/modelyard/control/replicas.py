"""Replica lifecycle: start (from the warm pool when it can), health, scale-down, repair.

A replica starts from a warm-pool worker of its version when there is one, else from this node's
cache of the model files; it joins the routing table once healthy, with its admission limit from
its KV capacity. Every tick its health is probed (a `ReplicaHealth` collaborator): the dead and
the broken are replaced, and their devices given back here. `converge` starts or drains
replicas until the live ones match what the autoscaler wants. A replica whose node is being
taken away (the backend's `leaving`: Ray draining the node on a spot notice) leaves routing at
once and drains until the node's deadline (`leave_preempted`); no longer live, it is replaced
by `converge` in the same tick.

The controller reports what came of a start (`ReplicaOutcome`) and which replicas `converge`
wants started; the endpoint's manager acts on both (status, the good version, the start itself).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from modelyard.config import PlatformSettings
from modelyard.control import adapters, runtimes
from modelyard.control.backends.base import (
    Backend,
    ReplicaSpec,
    Waiting,
    placed_devices,
    wait_healthy,
)
from modelyard.control.devices import inventory, pinning_env
from modelyard.control.endpoint_status import StatusChange
from modelyard.control.health import ReplicaHealth
from modelyard.control.load_progress import CountingStore, copy_meter
from modelyard.control.model_kind import LLM
from modelyard.control.node_cache import NodeCache
from modelyard.control.placement import Placement, ReplicaRequest
from modelyard.control.registry import Registry
from modelyard.control.sizing import replica_bytes_per_device
from modelyard.control.state import EndpointState, Replica, spawn
from modelyard.control.warm_pool import WarmPool
from modelyard.core.model_files import inspect_local
from modelyard.core.routing import ReplicaRoute, RoutingTable
from modelyard.core.status import EndpointStatus, ReplicaState, StatusTrigger
from modelyard.store import repository as repo

log = logging.getLogger(__name__)

_MAX_RESTART_BACKOFF_S = 60.0


@dataclass(frozen=True)
class ReplicaOutcome:
    """What starting one replica came to, for the endpoint's manager to act on."""

    served: bool = False  # it joined routing: the endpoint's status may change
    version_good: bool = False  # it serves the endpoint's version, not yet recorded as good
    status: StatusChange | None = None  # a status the endpoint takes (it failed, or no room)


def scale_down_order(live: list[Replica], placement: Placement) -> list[Replica]:
    """Which replicas a scale-down removes first: those not serving yet (nothing to drain),
    then the ready ones whose removal empties devices rather than punching holes in many
    (`Placement.drain_order`), so that emptied devices can be given back; newest first among
    equals, since older replicas hold warmer prefix caches."""
    newest_first = sorted(live, key=lambda r: -r.started_at)
    ready = ReplicaState.READY
    serving = {r.placement_id: r for r in newest_first if r.state is ready and r.placement_id}
    others = [r for r in newest_first if r.state is not ready or not r.placement_id]
    others.sort(key=lambda r: r.state is ready)  # stable: newest first within each group
    return others + [serving[i] for i in placement.drain_order(list(serving))]


class ReplicaController:
    def __init__(
        self,
        settings: PlatformSettings,
        backend: Backend,
        routing: RoutingTable,
        registry: Registry,
        endpoints: dict[str, EndpointState],
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.routing = routing
        self.registry = registry
        self.endpoints = endpoints  # read only: which versions are in use
        self.node_cache = NodeCache(  # its reads counted: a replica's `copying` progress
            settings.data_dir / "node-cache",
            CountingStore(registry.store),
            settings.node_cache_bytes,
        )
        self.placement = Placement(inventory(settings.devices))
        self.warm_pool = WarmPool(
            settings, backend, registry, self.node_cache, self.default_engine_env(), self.placement
        )
        self._http = httpx.AsyncClient(timeout=settings.health_probe_timeout_s)
        self.health = ReplicaHealth(settings, backend, routing, self._http)
        # Engine settings of a version other than the endpoint's own (a canary's overrides), by
        # (endpoint id, version id); written by `control/versions.py`.
        self.version_engine: dict[tuple[str, str], dict[str, str]] = {}
        # A server folder's size figure (no registry row records it), by endpoint id.
        self._local_params: dict[str, int] = {}

    async def close(self) -> None:
        await self.warm_pool.stop()
        await self._http.aclose()

    @staticmethod
    def new_replica(state: EndpointState) -> Replica:
        # Listed before it starts, so the reconciler counts it and does not start another.
        replica = Replica(repo.new_id("rep"), version_id=state.row.version_id)
        state.replicas.append(replica)
        return replica

    async def fetch_model(self, state: EndpointState, version_id: str | None = None) -> Path:
        """The version's files (the endpoint's own by default) from this node's cache (copied
        from the store and verified on a miss); called before every replica start, since an
        idle version may have been evicted."""
        version_id = version_id or state.row.version_id
        assert version_id is not None
        version = await asyncio.to_thread(self.registry.by_id, version_id)
        in_use = {
            r.version_id
            for s in self.endpoints.values()
            for r in s.live
            if r.version_id is not None
        } | {s.row.version_id for s in self.endpoints.values() if s.live and s.row.version_id}
        with copy_meter(state, version.total_size):
            entry = await asyncio.to_thread(self.node_cache.fetch, version, in_use)
        state.last_fetch = "node cache" if entry.hit else "artifact store"
        return entry.path

    async def run(
        self, state: EndpointState, replica: Replica, waiting: Waiting | None = None
    ) -> ReplicaOutcome:
        """Start `replica` and have it serve; any failure on the way fails it (never left
        `starting`), and the endpoint with it while no other replica serves. `waiting` is told
        why while the backend waits for room to start it (Ray full)."""
        try:
            return await self._run(state, replica, waiting)
        except Exception as exc:
            log.exception("replica %s of %s failed to start", replica.replica_id, state.row.id)
            return await self._start_failed(state, replica, exc)

    async def _start_failed(
        self, state: EndpointState, replica: Replica, exc: Exception
    ) -> ReplicaOutcome:
        replica.state = ReplicaState.FAILED
        state.failures += 1
        replica.error = state.last_error = str(exc)
        log.warning("replica %s of %s failed to start: %s", replica.replica_id, state.row.id, exc)
        if replica.handle is not None:
            await self.backend.stop(replica.handle)
        # The next attempt goes to another device if one fits (a bad device, or one whose
        # memory something outside the platform took, should not fail every retry).
        state.failed_devices.update(replica.devices)
        self.release(replica)
        if state.serving:
            return ReplicaOutcome()
        why = f"replica failed to start: {exc}"
        return ReplicaOutcome(
            status=StatusChange(EndpointStatus.FAILED, why, StatusTrigger.REPLICA_START_FAILED)
        )

    async def _run(
        self, state: EndpointState, replica: Replica, waiting: Waiting | None
    ) -> ReplicaOutcome:
        assert state.model_path is not None
        path = state.model_path
        if replica.version_id is not None and state.kind == LLM:
            try:
                path = await self.fetch_model(state, replica.version_id)
            except Exception as exc:
                raise RuntimeError(f"cannot fetch the model: {exc}") from exc
            if replica.version_id == state.row.version_id:
                state.model_path = path
        key = (state.row.id, replica.version_id or "")
        own_env = self.version_engine.get(key, state.engine_env)
        if adapters.serves_adapters(state):  # registry LoRA adapters of its base, on this node
            names = await asyncio.to_thread(adapters.sync, self.registry, self.node_cache, state)
            self.routing.set_adapters(state.route, names)
            folder = adapters.adapter_folder(self.node_cache, state.row.id)
            own_env = {**own_env, adapters.ENV: str(folder)}
        native = state.row.framework == runtimes.NATIVE
        if state.kind == LLM and native:  # the warm pool holds native workers only
            taken = await self.warm_pool.take(replica.version_id, state.row.model_name, own_env)
            if taken is not None:  # a preloaded replica of this version: no load at all
                replica.handle, replica.placement_id = taken
                replica.devices = self._device_names(replica.placement_id)
                state.last_fetch = "warm pool"
                return await self.serve(state, replica)
        env = {**self.default_engine_env(), **own_env}
        params = await self.param_count(state, replica.version_id)
        no_room = self._place(state, replica, env, params)
        if no_room is not None:
            no_room_status = StatusChange(
                EndpointStatus.UNSCHEDULABLE, no_room, StatusTrigger.NO_ROOM
            )
            return ReplicaOutcome(status=no_room_status)
        spec = ReplicaSpec(
            replica_id=replica.replica_id,
            endpoint_id=state.row.id,
            model_path=path,
            served_model_name=state.row.model_name,
            engine_env=env,
            version_id=replica.version_id,
            workload=str(state.row.hardware.get("workload", "real-time")),
            **placed_devices(self.placement, replica.replica_id),
            **runtimes.spec_fields(
                self.settings,
                state.row.framework,
                state.row.engine_options or {},
                path,
                state.row.model_name,
            ),
        )
        try:
            replica.handle = await self.backend.start(spec, waiting)
            await wait_healthy(
                self.backend, replica.handle, self._http, self.settings.replica_start_timeout_s
            )
        except Exception as exc:
            return await self._start_failed(state, replica, exc)
        return await self.serve(state, replica)

    async def param_count(self, state: EndpointState, version_id: str | None) -> int:
        """The model's size figure: a registry version's as recorded at push; a server folder's
        read once per endpoint with the bounded parser. Either way off the event loop."""
        if version_id is not None:
            return await asyncio.to_thread(self.registry.param_count, version_id)
        cached = self._local_params.get(state.row.id)
        if cached is None:
            assert state.model_path is not None
            facts = await asyncio.to_thread(inspect_local, state.model_path)
            cached = self._local_params[state.row.id] = facts.param_count
        return cached

    def forget(self, endpoint_id: str) -> None:
        self._local_params.pop(endpoint_id, None)

    def _place(
        self, state: EndpointState, replica: Replica, env: dict[str, str], params: int
    ) -> str | None:
        """Reserve the replica's devices (and tell the worker which); why not, if none fits."""
        count = max(1, int(state.row.hardware.get("gpu_count", 1)))
        need = replica_bytes_per_device(
            params,
            state.engine.model_copy(update={"tensor_parallel_size": count}),
            on_cuda=any(d.kind == "cuda" for d in self.placement.devices),
            overhead=self.settings.replica_overhead_bytes,
        )
        request = ReplicaRequest(
            replica.replica_id, state.row.id, need, count, avoid=frozenset(state.failed_devices)
        )
        result = self.placement.place([request])
        if replica.replica_id in result.unschedulable:
            why = result.unschedulable[replica.replica_id]
            replica.state, replica.error = ReplicaState.FAILED, f"unschedulable: {why}"
            return why
        devices = result.assignments[replica.replica_id]
        replica.placement_id = replica.replica_id
        replica.devices = [d.qualified_name for d in devices]
        if count > 1:
            env["MODELYARD_TENSOR_PARALLEL_SIZE"] = str(count)
        env.update(pinning_env(devices))
        return None

    def _device_names(self, placement_id: str | None) -> list[str]:
        devices = self.placement.assignment(placement_id) if placement_id else None
        return [d.qualified_name for d in devices or []]

    def release(self, replica: Replica) -> None:
        """Give the replica's devices back (it stopped, failed or never started)."""
        if replica.placement_id is not None:
            self.placement.release(replica.placement_id)
            replica.placement_id = None

    async def serve(self, state: EndpointState, replica: Replica) -> ReplicaOutcome:
        """A started, healthy replica joins its endpoint's routing."""
        assert replica.handle is not None
        if replica.state is ReplicaState.DRAINING:  # scaled down while it was starting
            await self.backend.stop(replica.handle)
            self.release(replica)
            replica.state = ReplicaState.STOPPED
            return ReplicaOutcome()
        replica.state = ReplicaState.READY
        replica.error = None  # e.g. what it waited for while it started
        state.clear_failures()
        current = replica.version_id == state.row.version_id
        replica.ready_after_s = time.time() - replica.started_at
        replica.route = ReplicaRoute(
            replica.replica_id, replica.handle.url, version_id=replica.version_id
        )
        await self.health.probe(replica, state)  # its load report and limits, before traffic
        self.routing.add_replica(state.route, replica.route)
        good = current and replica.version_id != state.row.good_version_id
        return ReplicaOutcome(served=True, version_good=good)

    def default_engine_env(self) -> dict[str, str]:
        env = {"MODELYARD_CACHE_DIR": str(self.node_cache.engine_cache)}
        env.update(
            {f"MODELYARD_{k.upper()}": str(v) for k, v in self.settings.worker_engine.items()}
        )
        return env

    async def check_health(self, state: EndpointState) -> None:
        """Each tick: probe the endpoint's replicas (`ReplicaHealth.check`); the devices of the
        ones taken out come back."""
        for replica in await self.health.check(state):
            self.release(replica)

    def drop_route(self, state: EndpointState, replica: Replica) -> None:
        if replica.route is not None:
            self.routing.drop_replica(state.route, replica.route)

    def leave_preempted(self, state: EndpointState) -> list[Replica]:
        """The endpoint's live replicas on a node the backend says is going (`leaving`): out of
        routing at once (draining, as at a scale-down), stopped once their requests in flight
        are done or the node's deadline comes; one still starting is stopped when it would
        serve. They no longer count as live, so `converge` starts their replacements. Returns
        the replicas moved."""
        leaving = self.backend.leaving()
        moved: list[Replica] = []
        for replica in state.live:
            if replica.replica_id not in leaving:
                continue
            deadline = leaving[replica.replica_id]
            serving = replica.state is not ReplicaState.STARTING
            replica.state = ReplicaState.DRAINING
            replica.preempted = True
            left = "" if deadline is None else f", {max(0.0, deadline - time.time()):.0f}s left"
            replica.error = f"its node is being preempted{left}; a replacement is starting"
            log.warning("replica %s of %s: %s", replica.replica_id, state.row.id, replica.error)
            if serving:
                if replica.route is not None:
                    self.routing.mark_unready(replica.route, state.route)
                spawn(state, self.drain(state, replica, until=deadline))
            moved.append(replica)
        return moved

    def converge(self, state: EndpointState, keep: frozenset[str] = frozenset()) -> list[Replica]:
        """Drain replicas, or list new ones to start (the caller runs them), until the live
        ones of the endpoint's version match `desired`; replicas of an older version serve
        until the new ones all do, those of the versions in `keep` (a canary, the previous
        version kept warm) stay."""
        live = state.current
        stale = [r for r in state.live if r.version_id not in {state.row.version_id, *keep}]
        ready = sum(r.state is ReplicaState.READY for r in live)
        if stale and ready >= max(state.desired, 1):
            for replica in stale:
                replica.state = ReplicaState.DRAINING
                if replica.route is not None:
                    self.routing.mark_unready(replica.route)
                spawn(state, self.drain(state, replica))
        missing = state.desired - len(live)
        if missing > 0 and time.monotonic() >= state.next_restart_at:
            if state.failures:  # replacing failed replicas: back off
                state.restarts += missing
                backoff = min(_MAX_RESTART_BACKOFF_S, 2.0 ** min(state.failures, 6))
                state.next_restart_at = time.monotonic() + backoff
            return [self.new_replica(state) for _ in range(missing)]
        if missing < 0:
            for replica in scale_down_order(live, self.placement)[:-missing]:
                replica.state = ReplicaState.DRAINING
                if replica.route is not None:
                    self.routing.mark_unready(replica.route)
                    spawn(state, self.drain(state, replica))
        return []

    async def drain(
        self, state: EndpointState, replica: Replica, until: float | None = None
    ) -> None:
        """Scale-down of one replica: no new requests, wait for those in flight (at most
        `replica_drain_timeout_s`, or until `until`, wall-clock seconds: its node's deadline),
        then stop."""
        wait_s = self.settings.replica_drain_timeout_s if until is None else until - time.time()
        deadline = time.monotonic() + wait_s
        route = replica.route
        # Polls counters the gateway moves; an event per counter would cost the hot path.
        while route is not None and route.outstanding > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        self.drop_route(state, replica)
        if replica.handle is not None:
            await self.backend.stop(replica.handle)
        self.release(replica)
        replica.state = ReplicaState.STOPPED
