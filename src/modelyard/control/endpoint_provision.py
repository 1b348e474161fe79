"""Endpoint provisioning: adopt a row (routing entry, autoscaler, load tracker), start its
replicas or register it with the encoder host, and drain and stop them when it is deleted.

A collaborator of `EndpointManager` (control/endpoints.py), built by it with the manager's
endpoints and its other collaborators; it holds no state of its own. In a cluster, a new leader's
manager hands it a `ReplicaTakeover` (control/takeover.py): provisioning then first takes over
the replicas the previous leader left running and starts only those still missing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from modelyard.config import PlatformSettings
from modelyard.control.autoscaler import Autoscaler
from modelyard.control.backends.base import Backend
from modelyard.control.encoder_pool import EncoderPool
from modelyard.control.endpoint_config import EndpointConfig
from modelyard.control.endpoint_status import EndpointStatuses
from modelyard.control.model_card import describe
from modelyard.control.model_kind import LLM, detect
from modelyard.control.reconcile import Reconciler
from modelyard.control.replicas import ReplicaController
from modelyard.control.scaling import LoadTracker
from modelyard.control.state import EndpointState, Replica, spawn
from modelyard.control.takeover import ReplicaTakeover
from modelyard.control.versions import Versions
from modelyard.core.routing import EndpointRoute, RoutingTable
from modelyard.core.status import EndpointStatus, ReplicaState, StatusTrigger
from modelyard.store.tables import Endpoint

log = logging.getLogger(__name__)


class Provisioner:
    def __init__(
        self,
        settings: PlatformSettings,
        backend: Backend,
        routing: RoutingTable,
        endpoints: dict[str, EndpointState],
        replicas: ReplicaController,
        encoders: EncoderPool,
        statuses: EndpointStatuses,
        versions: Versions,
        reconciler: Reconciler,
        takeover: ReplicaTakeover | None = None,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.routing = routing
        self.endpoints = endpoints  # the manager's: adopted rows join, deleted ones leave
        self.replicas = replicas
        self.encoders = encoders
        self.statuses = statuses
        self.versions = versions
        self.reconciler = reconciler
        self.takeover = takeover
        self.refused: set[str] = set()  # stored endpoints whose configuration did not parse

    def adopt(
        self, row: Endpoint, config: EndpointConfig, path: Path | None = None
    ) -> EndpointState:
        """Run `row` with its parsed configuration (`endpoint_config.parse`, already checked)."""
        route = EndpointRoute(
            endpoint_id=row.id,
            tenant_id=row.tenant_id,
            model_name=row.model_name,
            public=row.public,
            version_id=row.version_id,
            max_tokens_cap=config.engine.max_tokens_cap,
            sampling_defaults=config.sampling_defaults,
            lora_dir=config.engine.lora_dir is not None,
        )
        state = EndpointState(
            row=row,
            route=route,
            model_path=path,
            engine_env=config.engine_env,
            engine=config.engine,
            desired=max(1, config.min_replicas),
        )
        state.autoscaler = Autoscaler(config.policy)
        state.load = LoadTracker(config.policy.metric)
        self.endpoints[row.id] = state
        self.routing.publish(route)
        spawn(state, self._provision(state))
        return state

    async def refuse_stored(self, row: Endpoint, reason: str) -> None:
        """A stored row whose configuration no longer parses: listed as failed with why (its
        owner can read and delete it), answered with a 503, never provisioned."""
        log.error("endpoint %s is not started: %s", row.id, reason)
        route = EndpointRoute(
            endpoint_id=row.id,
            tenant_id=row.tenant_id,
            model_name=row.model_name,
            public=row.public,
            version_id=row.version_id,
            max_tokens_cap=2**31 - 1,  # never served: no request should fail on it first
        )
        state = EndpointState(row=row, route=route, desired=0)
        self.endpoints[row.id] = state
        self.refused.add(row.id)
        self.routing.publish(route)
        message = (
            f"its stored configuration is invalid ({reason[:500]}); delete it and deploy again"
        )
        await self.statuses.set(state, EndpointStatus.FAILED, message, StatusTrigger.CONFIG_INVALID)

    async def _provision(self, state: EndpointState) -> None:
        """Prepare the model files and start the endpoint's replicas (those a takeover did not
        bring), or register it with the encoder host (an adopted one: its entry is published
        once its model is registered there again)."""
        try:
            await self._provision_taken_over(state)
        finally:
            if self.takeover is not None:
                self.takeover.release(state.row.id)

    async def _provision_taken_over(self, state: EndpointState) -> None:
        running = await self._take_over(state)
        state.desired = max(state.desired, running)
        try:
            path = state.model_path
            if path is None:
                if state.row.version_id is None:
                    path = Path(state.row.artifact)
                else:
                    path = await self.replicas.fetch_model(state)
            kind = await asyncio.to_thread(detect, path)
            route = state.route
            route.model_kind, route.capabilities = await asyncio.to_thread(
                describe, path, kind, state.engine
            )
            # The path and the kind become known together: a request arriving while the kind
            # is read (`activate`: a path and no kind looked like an LLM's) started an engine
            # worker for an encoder folder, which exits ("model_type 'bert' is not supported").
            state.model_path, state.kind = path, kind
        except Exception as exc:
            why = f"cannot prepare the model files: {exc}"
            await self.statuses.set(state, EndpointStatus.FAILED, why, StatusTrigger.PREPARE_FAILED)
            return
        if state.kind != LLM:
            await self._provision_encoder(state)
            return
        missing = state.desired - running
        replicas = [self.replicas.new_replica(state) for _ in range(missing)]
        await asyncio.gather(*(self.reconciler.start_replica(state, r) for r in replicas))

    async def _take_over(self, state: EndpointState) -> int:
        """Replicas a previous leader left running serve again (cluster mode); how many of them
        run the endpoint's version."""
        if self.takeover is None:
            return 0
        running = 0
        async with self.takeover.adopt(state) as adopted:
            for replica in adopted:
                state.replicas.append(replica)
                await self.replicas.serve(state, replica)
                self.versions.started(state, replica)
                running += replica.version_id == state.row.version_id
            if adopted:
                await self.statuses.refresh(state)
        return running

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

    async def drain_and_stop(self, state: EndpointState) -> None:
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
        await self.statuses.deleted(state.row.id, state)
        self.endpoints.pop(state.row.id, None)
        self.replicas.forget(state.row.id)
