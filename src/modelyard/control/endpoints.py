"""Endpoints: deploy a model version as replicas, roll it to another version, read and delete.

The database holds what should exist (the endpoint rows); this manager holds what does exist
(replica processes via a backend). Its verbs are short: each checks the caller, then hands the
work to the module whose job it is: `deploy` (validation), `reconcile` (the loop that keeps
replicas matching what should run, and starts them), `rollout` (versions), `endpoint_status`
(the one writer of statuses) and `endpoint_view` (the JSON the API shows). On start it
re-provisions every live endpoint in the database.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from modelyard.config import EngineSettings, PlatformSettings
from modelyard.control import deploy as validation
from modelyard.control.autoscaler import Autoscaler, ScalingPolicy
from modelyard.control.backends.base import Backend
from modelyard.control.encoder_pool import EncoderPool
from modelyard.control.endpoint_status import EndpointStatuses
from modelyard.control.endpoint_view import endpoint_view
from modelyard.control.model_kind import LLM, detect
from modelyard.control.reconcile import Reconciler
from modelyard.control.registry import Registry
from modelyard.control.replicas import ReplicaController
from modelyard.control.rollout import Rollouts
from modelyard.control.scaling import LoadTracker
from modelyard.control.state import EndpointState, Replica, engine_env, spawn
from modelyard.core.errors import Conflict, Invalid, NotFound
from modelyard.core.identity import Principal
from modelyard.core.routing import EndpointRoute, RoutingTable
from modelyard.core.status import EndpointStatus, ReplicaState, StatusTrigger
from modelyard.protocol.management import DeployRequest
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import Endpoint


class EndpointManager:
    def __init__(
        self,
        settings: PlatformSettings,
        db: Database,
        registry: Registry,
        backend: Backend,
        routing: RoutingTable,
    ) -> None:
        self.settings = settings
        self.db = db
        self.registry = registry
        self.backend = backend
        self.routing = routing
        self.endpoints: dict[str, EndpointState] = {}
        self.replicas = ReplicaController(settings, backend, routing, registry, self.endpoints)
        self.encoders = EncoderPool(settings, backend, self.replicas.placement, routing)
        self.node_cache = self.replicas.node_cache
        self.warm_pool = self.replicas.warm_pool
        self.statuses = EndpointStatuses(db, routing)
        self.rollouts = Rollouts(settings, db, registry, routing)
        self.reconciler = Reconciler(
            settings, self.endpoints, self.replicas, self.encoders, self.statuses, self.rollouts,
            routing,
        )  # fmt: skip

    # ----- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        def load() -> list[Endpoint]:
            with self.db.session() as s:
                return list(repo.live_endpoints(s))

        rows = await asyncio.to_thread(load)
        for row in rows:
            if row.status == EndpointStatus.DRAINING.value:  # interrupted delete: finish it
                await asyncio.to_thread(self._mark_deleted, row.id)
                continue
            self._adopt(row)
        self.reconciler.start()

    async def stop(self) -> None:
        self.reconciler.stop()
        for state in self.endpoints.values():
            for task in state.tasks:
                task.cancel()
        await self.replicas.close()
        await self.backend.stop_all()
        await self.encoders.close()
        self.reconciler.save_history()

    # ----- deploy ----------------------------------------------------------------------------

    async def deploy(self, principal: Principal, req: DeployRequest) -> dict[str, Any]:
        validation.check_request(principal, req)
        path, version = await asyncio.to_thread(
            validation.resolve_artifact, self.settings, self.registry, principal, req.model_artifact
        )
        row = validation.new_row(principal, req, version)

        def insert() -> None:
            with self.db.session() as s:
                if repo.live_endpoint_by_name(s, principal.tenant_id, req.model_name):
                    raise Conflict(
                        f"an endpoint named {req.model_name!r} already exists; delete it first",
                        param="model_name",
                        code="endpoint_exists",
                    )
                s.add(row)

        await asyncio.to_thread(insert)
        state = self._adopt(row, path)
        return {
            "endpoint_id": row.id,
            "status": state.status,
            "estimated_ready_seconds": validation.estimated_ready_seconds(path, version),
        }

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
            replica.route = await self.encoders.register(state.row.id, state.model_path)
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

    def activate(self, endpoint_id: str) -> None:
        """The gateway's verb (handed to it by the composition root): a request arrived for
        `endpoint_id` while no replica serves it."""
        state = self.endpoints.get(endpoint_id)
        if state is not None:
            self.reconciler.activate(state)

    # ----- versions ----------------------------------------------------------------------------

    async def update(self, principal: Principal, endpoint_id: str, artifact: str) -> dict[str, Any]:
        """Roll the endpoint out to another registry version. Its replicas keep serving until
        the new version's are ready; if those fail to load, the endpoint falls back."""
        principal.require("admin")
        state = self._get(principal, endpoint_id)
        if state.kind not in (None, LLM):
            raise Invalid(
                "encoder endpoints are updated by deploying again", param="model_artifact"
            )
        version = await asyncio.to_thread(self.registry.resolve, principal.tenant_id, artifact)
        assert version is not None
        status = state.status
        if version.version_id != state.row.version_id:
            rolling_out = await self.rollouts.start(state, version)
            await self.statuses.apply(state, rolling_out)
            status = rolling_out.status
        return {"endpoint_id": endpoint_id, "status": status, "version_id": version.version_id}

    # ----- read and delete -------------------------------------------------------------------

    def _get(self, principal: Principal, endpoint_id: str) -> EndpointState:
        state = self.endpoints.get(endpoint_id)
        visible = state is not None and (
            principal.platform_admin or state.row.tenant_id == principal.tenant_id
        )
        if not visible or state is None:
            raise NotFound(f"endpoint {endpoint_id!r} not found", code="endpoint_not_found")
        return state

    def list(self, principal: Principal, base_url: str) -> list[dict[str, Any]]:
        return [
            endpoint_view(s, base_url)
            for s in self.endpoints.values()
            if principal.platform_admin or s.row.tenant_id == principal.tenant_id
        ]

    def get(self, principal: Principal, endpoint_id: str, base_url: str) -> dict[str, Any]:
        return endpoint_view(self._get(principal, endpoint_id), base_url)

    async def delete(self, principal: Principal, endpoint_id: str) -> dict[str, Any]:
        principal.require("admin")
        state = self._get(principal, endpoint_id)
        if state.status is EndpointStatus.DRAINING:
            return {"endpoint_id": endpoint_id, "status": EndpointStatus.DRAINING}
        await self.statuses.set(state, EndpointStatus.DRAINING, None, StatusTrigger.DELETING)
        state.status, state.trigger = EndpointStatus.DRAINING, StatusTrigger.DELETING
        self.routing.remove(endpoint_id)  # no new requests from here on
        spawn(state, self._drain_and_stop(state))
        return {"endpoint_id": endpoint_id, "status": EndpointStatus.DRAINING}

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

    def _mark_deleted(self, endpoint_id: str) -> None:
        with self.db.session() as s:
            row = s.get(Endpoint, endpoint_id)
            if row is not None:
                row.deleted_at = repo.now()
                row.status = EndpointStatus.DELETED.value

    async def wait_ready(self, endpoint_id: str, timeout_s: float) -> str:
        """For tests and bootstrap: wait until the endpoint is ready or failed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.endpoints.get(endpoint_id)
            if state is None:
                return "deleted"
            if state.status in (EndpointStatus.READY, EndpointStatus.FAILED):
                return state.status
            await asyncio.sleep(0.1)
        return "timeout"
