"""The reconcile loop: every tick, each endpoint's replicas are made to match what should run.

Dead replicas are replaced, unhealthy ones leave the routing table until they answer again (and
are replaced if they do not), those on a node being taken away (a spot notice) leave it and are
replaced at once, draining until the node's deadline, the endpoint's versions tick
(`control/version_tick.py`: a rollout promoted once it serves or fallen back when it cannot
start, a canary judged against its SLO; the gate's moves are recorded in the audit log as the
platform's doing, actor `system`), each endpoint's autoscaler sets how many replicas it should
have (down to zero when idle; a request for an endpoint at zero activates it at once), and the
status says what came of it.
The shared encoder host is repaired here too. Starting a replica happens here for every caller,
so what a start came to (`ReplicaOutcome`) is acted on in one place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from modelyard.config import PlatformSettings
from modelyard.control.audit import AuditLog
from modelyard.control.encoder_pool import EncoderPool
from modelyard.control.endpoint_scaler import Scaler
from modelyard.control.endpoint_status import EndpointStatuses, StatusChange
from modelyard.control.model_kind import LLM
from modelyard.control.prewarm import TrafficHistory
from modelyard.control.replicas import ReplicaController
from modelyard.control.state import EndpointState, Replica, spawn
from modelyard.control.version_tick import VersionTicker
from modelyard.control.versions import Versions
from modelyard.core.routing import RoutingTable
from modelyard.core.status import EndpointStatus, StatusTrigger

log = logging.getLogger(__name__)

_HISTORY_SAVE_EVERY_S = 60


class Reconciler:
    def __init__(
        self,
        settings: PlatformSettings,
        endpoints: dict[str, EndpointState],
        replicas: ReplicaController,
        encoders: EncoderPool,
        statuses: EndpointStatuses,
        routing: RoutingTable,
        versions: Versions,
        audit: AuditLog | None = None,
    ) -> None:
        self.settings = settings
        self.endpoints = endpoints
        self.replicas = replicas
        self.encoders = encoders
        self.statuses = statuses
        self.routing = routing
        self.versions = versions
        self.ticker = VersionTicker(settings, versions, replicas)
        self.audit = audit
        self.history = TrafficHistory()
        self.scaler = Scaler(settings, self.history)
        self._history_path: Path = settings.data_dir / "traffic_history.json"
        self._history_saved = time.monotonic()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    async def start_replica(self, state: EndpointState, replica: Replica) -> None:
        """Start `replica` and act on what came of it."""

        async def waiting(why: str) -> None:
            # The backend has no room for it yet (Ray full): the status says so at once, and
            # while nothing serves the gateways answer 503 instead of holding requests.
            replica.error = why
            if state.serving:
                await self.statuses.refresh(state)  # degraded, naming why (`why_degraded`)
            else:
                message = f"{why}; it starts when room frees up"
                no_room = StatusChange(EndpointStatus.UNSCHEDULABLE, message, StatusTrigger.NO_ROOM)
                await self.statuses.apply(state, no_room)

        outcome = await self.replicas.run(state, replica, waiting)
        self.versions.started(state, replica)
        if outcome.version_good:
            await self.versions.mark_good(state)
        if outcome.served and replica.version_id != state.row.version_id:
            await self._versions(state)  # a rollout is promoted as soon as it serves
        if outcome.status is not None:
            await self.statuses.apply(state, outcome.status)
        if outcome.served:
            await self.statuses.refresh(state)

    def activate(self, state: EndpointState) -> None:
        """A request for an endpoint with no replica serving: have one started now."""
        closed = (EndpointStatus.DRAINING, EndpointStatus.DELETED, EndpointStatus.FAILED)
        if state.status in closed or state.kind not in (None, LLM):
            return
        if state.autoscaler is not None:
            state.autoscaler.mark_active(time.monotonic())
        if state.live or state.model_path is None:
            return  # one is starting already (or the endpoint is still being provisioned)
        state.desired = max(state.desired, 1)
        waking = StatusChange(
            EndpointStatus.PROVISIONING, "scaling from zero", StatusTrigger.SCALE_FROM_ZERO
        )
        self.statuses.set_in_memory(state, waking)
        spawn(state, self.start_replica(state, self.replicas.new_replica(state)))

    def poke(self, state: EndpointState) -> None:
        """A version was added or changed roles: start what it needs now, not at the next
        tick."""
        spawn(state, self._versions(state))

    async def _versions(self, state: EndpointState) -> None:
        """The versions' tick: their replicas, the canary's SLO gate (audited)."""
        before = self._audit_view(state)
        done = await self.ticker.tick(state)
        for replica in done.starts:
            spawn(state, self.start_replica(state, replica))
        if done.action is not None and self.audit is not None:
            after = self._audit_view(state)
            if done.reason is not None:
                after["reason"] = done.reason
            await self.audit.record_endpoint(None, done.action, state.row.id, before, after)
        if done.status is not None:
            await self.statuses.apply(state, done.status)

    def _audit_view(self, state: EndpointState) -> dict[str, Any]:
        row = state.row
        return {
            "tenant_id": row.tenant_id,
            "version_id": state.target.version_id,
            "model_artifact": state.target.artifact,
            "weights": dict(state.route.weights),
            "last_rollback": row.last_rollback,
        }

    # ----- the loop --------------------------------------------------------------------------

    def start(self) -> None:
        self.history.load(self._history_path)
        self._task = asyncio.create_task(self._run(), name="endpoint-reconciler")

    def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()

    def save_history(self) -> None:
        self.history.save(self._history_path)

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.settings.health_check_interval_s)
            if time.monotonic() - self._history_saved > _HISTORY_SAVE_EVERY_S:
                await asyncio.to_thread(self.history.save, self._history_path)
                self._history_saved = time.monotonic()
            try:
                await self._reconcile_encoders()
                await self.replicas.warm_pool.tick()
            except Exception:
                log.exception("reconciling the encoder host or the warm pool failed")
            for state in list(self.endpoints.values()):
                try:
                    await self._reconcile(state)
                except Exception:
                    log.exception("reconciling endpoint %s failed", state.row.id)

    async def _reconcile(self, state: EndpointState) -> None:
        if state.status in (EndpointStatus.DRAINING, EndpointStatus.DELETED):
            return
        if state.model_path is None:
            return
        if state.kind != LLM:
            return  # encoder endpoints live and die with the shared host
        await self.replicas.check_health(state)
        self.replicas.leave_preempted(state)  # replaced by `converge` below
        await self._versions(state)
        self.scaler.autoscale(state, self.activate)
        # A canary or a version kept warm takes its room out of max_replicas: the stable
        # version runs within what they leave.
        state.desired = min(state.desired, self.versions.stable_cap(state))
        for replica in self.replicas.converge(state, self.versions.kept(state)):
            spawn(state, self.start_replica(state, replica))
        await self.statuses.refresh(state)

    async def _reconcile_encoders(self) -> None:
        live = [
            s
            for s in self.endpoints.values()
            if s.kind not in (None, LLM)
            and s.status in (EndpointStatus.READY, EndpointStatus.DEGRADED)
        ]
        if not live or await self.encoders.healthy():
            return
        for state in live:
            for route in state.route.replicas:
                self.routing.mark_unready(route, state.route)
        restarts = self.encoders.restarts
        try:
            await self.encoders.ensure()  # restarts it and registers every model again
        except Exception as exc:
            log.warning("encoder host restart failed: %s", exc)
            for state in live:
                await self.statuses.set(
                    state,
                    EndpointStatus.DEGRADED,
                    f"encoder host down: {exc}",
                    StatusTrigger.ENCODER_HOST_FAILED,
                )
            return
        for state in live:
            for replica in state.replicas:
                replica.handle = self.encoders.handle
                replica.devices = self.encoders.devices
            state.restarts += self.encoders.restarts - restarts
            recovered = StatusTrigger.ENCODER_HOST_READY
            await self.statuses.set(state, EndpointStatus.READY, None, recovered)
