"""Endpoint provisioning: adopt a row (routing entry, autoscaler, load tracker), start its
replicas or register it with the encoder host, and drain and stop them when it is deleted.

A mixin of `EndpointManager` (control/endpoints.py): it uses the manager's collaborators
(settings, db, routing, replicas, encoders, statuses, reconciler, backend) and holds no state.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

from modelyard.config import EngineSettings, PlatformSettings
from modelyard.control.autoscaler import Autoscaler, ScalingPolicy
from modelyard.control.model_kind import LLM, detect
from modelyard.control.scaling import LoadTracker
from modelyard.control.state import EndpointState, Replica, engine_env, spawn
from modelyard.core.routing import EndpointRoute, RoutingTable
from modelyard.core.status import EndpointStatus, ReplicaState, StatusTrigger
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import Endpoint

if TYPE_CHECKING:
    from modelyard.control.backends.base import Backend
    from modelyard.control.encoder_pool import EncoderPool
    from modelyard.control.endpoint_status import EndpointStatuses
    from modelyard.control.reconcile import Reconciler
    from modelyard.control.replicas import ReplicaController


class Provisioning:
    settings: PlatformSettings
    db: Database
    backend: Backend
    routing: RoutingTable
    endpoints: dict[str, EndpointState]
    replicas: ReplicaController
    encoders: EncoderPool
    statuses: EndpointStatuses
    reconciler: Reconciler

    def _adopt(self, row: Endpoint, path: Path | None = None) -> EndpointState:
        env, _ = engine_env(row.engine_options)
        # What the replicas will run with: the platform's worker defaults under the endpoint's.
        engine = EngineSettings(**{**self.settings.worker_engine, **row.engine_options})
        max_tokens_cap = engine.max_tokens_cap
        route = EndpointRoute(
            endpoint_id=row.id,
            tenant_id=row.tenant_id,
            model_name=row.model_name,
            public=row.public,
            version_id=row.version_id,
            max_tokens_cap=max_tokens_cap,
            sampling_defaults=row.sampling_defaults or {},
        )
        desired = max(1, int(row.hardware.get("min_replicas", 1)))
        state = EndpointState(
            row=row, route=route, model_path=path, engine_env=env, engine=engine, desired=desired
        )
        policy = ScalingPolicy.from_deploy(row.hardware, row.scaling)
        state.autoscaler = Autoscaler(policy)
        state.load = LoadTracker(policy.metric)
        self.endpoints[row.id] = state
        self.routing.publish(route)
        spawn(state, self._provision(state))
        return state

    async def _provision(self, state: EndpointState) -> None:
        try:
            if state.model_path is None:
                if state.row.version_id is None:
                    state.model_path = Path(state.row.artifact)
                else:
                    state.model_path = await self.replicas.fetch_model(state)
            state.kind = await asyncio.to_thread(detect, state.model_path)
        except Exception as exc:
            why = f"cannot prepare the model files: {exc}"
            await self.statuses.set(state, EndpointStatus.FAILED, why, StatusTrigger.PREPARE_FAILED)
            return
        if state.kind != LLM:
            await self._provision_encoder(state)
            return
        replicas = [self.replicas.new_replica(state) for _ in range(state.desired)]
        await asyncio.gather(*(self.reconciler.start_replica(state, r) for r in replicas))

    async def _provision_encoder(self, state: EndpointState) -> None:
        """An embedding or classifier model joins the shared encoder host (one per platform)."""
        assert state.model_path is not None
        state.desired = 1
        replica = Replica(f"encoder-host/{state.row.id}")
        state.replicas = [replica]
        try:
            params = await self.replicas.param_count(state, state.row.version_id)
            replica.route = await self.encoders.register(state.row.id, state.model_path, params)
        except Exception as exc:
            replica.state, replica.error = ReplicaState.FAILED, str(exc)
            why = f"the encoder host refused the model: {exc}"
            trigger = StatusTrigger.ENCODER_HOST_FAILED
            await self.statuses.set(state, EndpointStatus.FAILED, why, trigger)
            return
        replica.handle = self.encoders.handle
        replica.devices = self.encoders.devices
        replica.state = ReplicaState.READY
        replica.ready_after_s = time.time() - replica.started_at
        self.routing.set_upstream_model(state.route, state.row.id)
        self.routing.set_replicas(state.route, [replica.route])
        await self.statuses.set(state, EndpointStatus.READY, None, StatusTrigger.ENCODER_HOST_READY)

    async def _drain_and_stop(self, state: EndpointState) -> None:
        deadline = time.monotonic() + self.settings.replica_drain_timeout_s
        # Polls counters the gateway moves; an event per counter would cost the hot path.
        while state.route.outstanding > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        for task in list(state.tasks):
            if task is not asyncio.current_task():
                task.cancel()
        if state.kind not in (None, LLM):
            await self.encoders.unregister(state.row.id)
        else:
            for replica in state.replicas:
                if replica.handle is not None:
                    await self.backend.stop(replica.handle)
                self.replicas.release(replica)
        for replica in state.replicas:
            replica.state = ReplicaState.STOPPED
        await asyncio.to_thread(self._mark_deleted, state.row.id)
        state.status, state.trigger = EndpointStatus.DELETED, StatusTrigger.DELETING
        self.endpoints.pop(state.row.id, None)
        self.replicas.forget(state.row.id)

    def _mark_deleted(self, endpoint_id: str) -> None:
        with self.db.session() as s:
            row = s.get(Endpoint, endpoint_id)
            if row is not None:
                row.deleted_at = repo.now()
                row.status = EndpointStatus.DELETED.value
