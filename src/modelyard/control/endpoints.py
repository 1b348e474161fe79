"""Endpoints: deploy a model version as replicas, keep them healthy, scale them, drain them.

The database holds what should exist (the endpoint rows); this manager holds what does exist
(replica processes via a backend) and reconciles the two in a loop: dead replicas are replaced,
unhealthy ones leave the routing table until they answer again (and are replaced if they do not),
an endpoint with no replica serving says so and why, and the gateway is told when waiting will
not bring one (so requests fail fast instead of hanging), and each endpoint's autoscaler
sets how many replicas it should have (down to zero when idle; a request for an endpoint at
zero activates it at once). On start it re-provisions every live endpoint in the database.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from modelyard.config import EngineSettings, PlatformSettings
from modelyard.control.autoscaler import Autoscaler, ScalingPolicy
from modelyard.control.backends.base import Backend
from modelyard.control.encoder_pool import EncoderPool
from modelyard.control.model_kind import LLM, UnknownArchitecture, detect
from modelyard.control.prewarm import TrafficHistory
from modelyard.control.registry import Registry, ResolvedVersion
from modelyard.control.replicas import ReplicaController
from modelyard.control.scaling import LoadTracker, Scaler
from modelyard.control.state import EndpointState, Replica, engine_env, spawn
from modelyard.core.errors import Conflict, Forbidden, Invalid, NotFound
from modelyard.core.identity import Principal
from modelyard.core.routing import EndpointRoute, RoutingTable
from modelyard.core.status import EndpointStatus, ReplicaState, StatusTrigger
from modelyard.protocol.management import DeployRequest
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import Endpoint

log = logging.getLogger(__name__)

SUPPORTED_FRAMEWORKS = ("native",)


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
        self.replicas = ReplicaController(
            settings, backend, routing, registry, lambda: self.endpoints,
            self._set_status, self._update_status, self._mark_good,
        )  # fmt: skip
        self.encoders = EncoderPool(settings, backend, self.replicas.placement, routing)
        self.node_cache = self.replicas.node_cache
        self.warm_pool = self.replicas.warm_pool
        self.history = TrafficHistory()
        self.scaler = Scaler(settings, self.history)
        self._history_path = settings.data_dir / "traffic_history.json"
        self._history_saved = time.monotonic()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False

    # ----- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self.history.load(self._history_path)

        def load() -> list[Endpoint]:
            with self.db.session() as s:
                return list(repo.live_endpoints(s))

        for row in await asyncio.to_thread(load):
            if row.status == EndpointStatus.DRAINING.value:  # interrupted delete: finish it
                await asyncio.to_thread(self._mark_deleted, row.id)
                continue
            self._adopt(row)
        self._loop_task = asyncio.create_task(self._reconcile_loop(), name="endpoint-reconciler")

    async def stop(self) -> None:
        self._stopping = True
        if self._loop_task is not None:
            self._loop_task.cancel()
        for state in self.endpoints.values():
            for task in state.tasks:
                task.cancel()
        await self.replicas.close()
        await self.backend.stop_all()
        await self.encoders.close()
        self.history.save(self._history_path)

    # ----- deploy ----------------------------------------------------------------------------

    def _resolve_artifact(
        self, principal: Principal, artifact: str
    ) -> tuple[Path | None, ResolvedVersion | None]:
        if artifact.startswith(("s3://", "gs://", "http://", "https://")):
            raise Invalid(
                f"remote artifacts ({artifact.split(':', 1)[0]}://) need an object store, and "
                "none is configured; upload the model with `modelyard models push` and deploy "
                "it by its registry name",
                param="model_artifact",
                code="unsupported_artifact",
            )
        looks_like_path = artifact.startswith(("/", "./", "../", "~"))
        if not looks_like_path:
            return None, self.registry.resolve(principal.tenant_id, artifact)
        path = Path(artifact).expanduser().resolve()
        roots = [r.resolve() for r in self.settings.local_artifact_roots]
        if not principal.platform_admin and not any(path.is_relative_to(r) for r in roots):
            raise Forbidden(
                "deploying from a server path needs the platform admin (or a path under "
                "MODELYARD_LOCAL_ARTIFACT_ROOTS); push the model to the registry instead",
                param="model_artifact",
                code="path_not_allowed",
            )
        if not path.exists():
            raise Invalid(
                f"{path} does not exist on the server",
                param="model_artifact",
                code="artifact_not_found",
            )
        return path, None

    async def deploy(self, principal: Principal, req: DeployRequest) -> dict[str, Any]:
        principal.require("admin")
        if req.framework not in SUPPORTED_FRAMEWORKS:
            raise Invalid(
                f"framework {req.framework!r} is not supported; use 'native' (modelyard's own "
                "engine: continuous batching, paged KV cache, OpenAI-compatible)",
                param="framework",
                code="unsupported_framework",
            )
        if req.public and not principal.platform_admin:
            raise Forbidden("only the platform admin can deploy public endpoints", param="public")
        engine_env(req.engine)  # a bad option is a 400 now, not a failed replica later
        path, version = await asyncio.to_thread(
            self._resolve_artifact, principal, req.model_artifact
        )
        if path is not None:
            await asyncio.to_thread(_refuse_unknown_architecture, path)
        row = Endpoint(
            id=repo.new_id("ep"),
            tenant_id=principal.tenant_id,
            model_name=req.model_name,
            public=req.public,
            artifact=req.model_artifact
            if version is None
            else f"{version.model_name}:{version.version}",
            version_id=version.version_id if version else None,
            framework=req.framework,
            hardware=req.hardware.model_dump(),
            scaling=req.scaling.model_dump(),
            engine_options=req.engine,
            sampling_defaults=req.sampling_defaults.model_dump(exclude_none=True),
            status=EndpointStatus.PROVISIONING.value,
            status_message=None,
            created_at=repo.now(),
            deleted_at=None,
        )

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
        size = version.total_size if version else _size_of(path)
        return {
            "endpoint_id": row.id,
            "status": state.status,
            "estimated_ready_seconds": int(5 + size / 100e6),
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
            await self._set_status(state, EndpointStatus.FAILED, why, StatusTrigger.PREPARE_FAILED)
            return
        if state.kind != LLM:
            await self._provision_encoder(state)
            return
        replicas = [self.replicas.new_replica(state) for _ in range(state.desired)]
        await asyncio.gather(*(self.replicas.run(state, r) for r in replicas))

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
            await self._set_status(state, EndpointStatus.FAILED, why, trigger)
            return
        replica.handle = self.encoders.handle
        replica.devices = self.encoders.devices
        replica.state = ReplicaState.READY
        replica.ready_after_s = time.time() - replica.started_at
        self.routing.set_upstream_model(state.route, state.row.id)
        self.routing.set_replicas(state.route, [replica.route])
        await self._set_status(state, EndpointStatus.READY, None, StatusTrigger.ENCODER_HOST_READY)

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
                await self._set_status(
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
            await self._set_status(state, EndpointStatus.READY, None, recovered)

    async def _set_status(
        self,
        state: EndpointState,
        status: EndpointStatus,
        message: str | None,
        trigger: StatusTrigger,
    ) -> None:
        """One transition of the endpoint's status, naming what caused it."""
        if state.status is status and state.message == message:
            self._publish_availability(state)
            return
        if state.status in (EndpointStatus.DRAINING, EndpointStatus.DELETED):
            return
        state.status, state.trigger, state.message = status, trigger, message
        self._publish_availability(state)

        def write() -> None:
            with self.db.session() as s:
                row = s.get(Endpoint, state.row.id)
                if row is not None and row.deleted_at is None:
                    row.status, row.status_message = status.value, message

        await asyncio.to_thread(write)

    def _publish_availability(self, state: EndpointState) -> None:
        """Tell the gateway whether waiting can bring a replica: while none serves and the
        endpoint failed, has no room, or lost its replicas (a replacement is starting), requests
        get a 503 at once. The reason is for tenants: the details (errors, addresses) stay in
        the endpoint's status, which only its owner reads."""
        route = state.route
        reason: str | None = None
        retry_after = 10
        if not state.serving:
            if state.status is EndpointStatus.FAILED:
                reason, retry_after = "its model failed to start", 30
            elif state.status is EndpointStatus.UNSCHEDULABLE:
                reason, retry_after = "no device has room for it", 30
            elif state.status is EndpointStatus.DEGRADED:
                reason = "no replica is serving it right now; it is being replaced"
        # Wakes requests waiting for a replica when it changes.
        self.routing.set_unavailable(route, reason, retry_after)

    # ----- health and repair -----------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.settings.health_check_interval_s)
            if time.monotonic() - self._history_saved > 60:
                await asyncio.to_thread(self.history.save, self._history_path)
                self._history_saved = time.monotonic()
            try:
                await self._reconcile_encoders()
                await self.warm_pool.tick()
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
        await self._maybe_roll_back(state)
        self.scaler.autoscale(state, self._activate)
        self.replicas.converge(state)
        await self._update_status(state)

    def activate(self, endpoint_id: str) -> None:
        """The gateway's verb (handed to it by the composition root): a request arrived for
        `endpoint_id` while no replica serves it."""
        state = self.endpoints.get(endpoint_id)
        if state is not None:
            self._activate(state)

    def _activate(self, state: EndpointState) -> None:
        """A request for an endpoint with no replica serving: have one started now."""
        closed = (EndpointStatus.DRAINING, EndpointStatus.DELETED, EndpointStatus.FAILED)
        if state.status in closed or state.kind not in (None, LLM):
            return
        if state.autoscaler is not None:
            state.autoscaler.mark_active(time.monotonic())
        if state.live or state.model_path is None:
            return  # one is starting already (or the endpoint is still being provisioned)
        state.desired = max(state.desired, 1)
        state.status, state.message = EndpointStatus.PROVISIONING, "scaling from zero"
        state.trigger = StatusTrigger.SCALE_FROM_ZERO
        self._publish_availability(state)
        spawn(state, self.replicas.run(state, self.replicas.new_replica(state)))

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
        if version.version_id == state.row.version_id:
            return {
                "endpoint_id": endpoint_id,
                "status": state.status,
                "version_id": version.version_id,
            }
        ref = f"{version.model_name}:{version.version}"
        state.rollout_from = state.row.version_id
        await asyncio.to_thread(self._write_version, state, version.version_id, ref)
        state.clear_failures()
        state.next_restart_at = 0.0
        await self._set_status(
            state, EndpointStatus.ROLLING_OUT, f"rolling out {ref}", StatusTrigger.ROLLOUT_STARTED
        )
        return {
            "endpoint_id": endpoint_id,
            "status": EndpointStatus.ROLLING_OUT,
            "version_id": version.version_id,
        }

    def _write_version(self, state: EndpointState, version_id: str | None, artifact: str) -> None:
        with self.db.session() as s:
            row = s.get(Endpoint, state.row.id)
            assert row is not None
            row.version_id, row.artifact = version_id, artifact
        state.row.version_id, state.row.artifact = version_id, artifact
        self.routing.set_version(state.route, version_id)

    async def _mark_good(self, state: EndpointState) -> None:
        """The endpoint's version serves: it is what a failing rollout will fall back to."""

        def write() -> None:
            with self.db.session() as s:
                row = s.get(Endpoint, state.row.id)
                if row is not None:
                    row.good_version_id = state.row.version_id

        state.row.good_version_id = state.row.version_id
        await asyncio.to_thread(write)

    async def _maybe_roll_back(self, state: EndpointState) -> None:
        """A version that failed to load `rollout_attempts` times in a row, with none of its
        replicas ever ready, gives way to the last good version (the spec's tier 3)."""
        good = state.row.good_version_id
        failed_version = state.row.version_id
        if (
            good is None
            or good == failed_version
            or state.failures < self.settings.rollout_attempts
            or any(r.state is ReplicaState.READY for r in state.current)
        ):
            return
        version = await asyncio.to_thread(self.registry.by_id, good)
        why = state.last_error or "it failed to load"
        await asyncio.to_thread(
            self._write_version, state, good, f"{version.model_name}:{version.version}"
        )
        state.rollout_from = None
        state.clear_failures()
        state.next_restart_at = 0.0
        message = (
            f"version {failed_version} failed to load {self.settings.rollout_attempts} times "
            f"({why[:300]}); serving the last good version {version.model_name}:{version.version}"
        )
        log.warning("endpoint %s: %s", state.row.id, message)
        state.status, state.trigger = EndpointStatus.ROLLING_BACK, StatusTrigger.ROLLED_BACK
        await self._set_status(state, EndpointStatus.DEGRADED, message, StatusTrigger.ROLLED_BACK)

    async def _update_status(self, state: EndpointState) -> None:
        """ready = every desired replica serves; before that provisioning; after it degraded,
        with why (fewer serve than desired, or none while a replacement starts); failed and
        unschedulable stay until a replica serves; scaled_to_zero when the autoscaler wants
        none and none runs."""
        if state.trigger is StatusTrigger.ROLLED_BACK and state.status is EndpointStatus.DEGRADED:
            self._publish_availability(state)
            return  # stays reported until the next rollout
        if state.rollout_from is not None:
            self._publish_availability(state)
            return  # rolling_out until the new version serves or falls back
        ready = sum(r.state is ReplicaState.READY for r in state.current)
        gone = (ReplicaState.FAILED, ReplicaState.STOPPED)
        running = [r for r in state.replicas if r.state not in gone]
        served = state.status in (EndpointStatus.READY, EndpointStatus.DEGRADED)
        why = self._why_degraded(state)
        changed = StatusTrigger.REPLICAS_CHANGED
        if state.desired == 0 and not running:  # draining ones too must be gone
            await self._set_status(
                state, EndpointStatus.SCALED_TO_ZERO, None, StatusTrigger.SCALED_TO_ZERO
            )
        elif ready >= state.desired:
            await self._set_status(state, EndpointStatus.READY, None, changed)
        elif served and ready:
            message = f"{ready} of {state.desired} replicas ready" + (f": {why}" if why else "")
            await self._set_status(state, EndpointStatus.DEGRADED, message, changed)
        elif served:  # it served, and now no replica does
            message = f"no replica serving ({why or 'replicas lost'}); replacing it"
            await self._set_status(state, EndpointStatus.DEGRADED, message, changed)
        elif state.status is EndpointStatus.SCALED_TO_ZERO:  # the autoscaler woke it
            await self._set_status(
                state,
                EndpointStatus.PROVISIONING,
                "scaling from zero",
                StatusTrigger.SCALE_FROM_ZERO,
            )
        elif state.status is EndpointStatus.PROVISIONING:
            await self._set_status(
                state,
                EndpointStatus.PROVISIONING,
                f"{ready} of {state.desired} replicas ready",
                changed,
            )
        else:  # failed or unschedulable: kept, with their reason, until a replica serves
            self._publish_availability(state)

    @staticmethod
    def _why_degraded(state: EndpointState) -> str | None:
        """The failure behind missing replicas: a benched replica's, else the last one since a
        replica last came up (older ones are history, not the reason)."""
        for replica in state.replicas:
            if replica.state is ReplicaState.UNHEALTHY and replica.error:
                return replica.error
        return state.last_error if state.failures else None

    # ----- read and delete -------------------------------------------------------------------

    def _get(self, principal: Principal, endpoint_id: str) -> EndpointState:
        state = self.endpoints.get(endpoint_id)
        visible = state is not None and (
            principal.platform_admin or state.row.tenant_id == principal.tenant_id
        )
        if not visible or state is None:
            raise NotFound(f"endpoint {endpoint_id!r} not found", code="endpoint_not_found")
        return state

    def view(self, state: EndpointState, base_url: str) -> dict[str, Any]:
        row = state.row
        return {
            "endpoint_id": row.id,
            "object": "endpoint",
            "model_name": row.model_name,
            "status": state.status,
            "status_message": state.message,
            "public": row.public,
            "kind": state.kind,
            "model_artifact": row.artifact,
            "version_id": row.version_id,
            "good_version_id": row.good_version_id,
            "rollout_from": state.rollout_from,
            "model_files_from": state.last_fetch,
            "framework": row.framework,
            "hardware": row.hardware,
            "scaling": row.scaling,
            "engine": row.engine_options,
            "sampling_defaults": row.sampling_defaults or {},
            "created_at": int(repo.as_utc(row.created_at).timestamp()),
            "endpoint_url": f"{base_url}/v1/models/{row.id}",
            "autoscaling": {
                "desired": state.desired,
                "current": len(state.live),
                "last_decision": (
                    state.autoscaler.last.view()
                    if state.autoscaler and state.autoscaler.last
                    else None
                ),
                "recent_changes": [d.view() for d in state.decisions],
            },
            "replicas": {
                "desired": state.desired,
                "ready": state.serving,
                "restarts": state.restarts,
                "last_error": state.last_error,
                "items": [r.view() for r in state.replicas if r.state is not ReplicaState.STOPPED],
            },
        }

    def list(self, principal: Principal, base_url: str) -> list[dict[str, Any]]:
        return [
            self.view(s, base_url)
            for s in self.endpoints.values()
            if principal.platform_admin or s.row.tenant_id == principal.tenant_id
        ]

    def get(self, principal: Principal, endpoint_id: str, base_url: str) -> dict[str, Any]:
        return self.view(self._get(principal, endpoint_id), base_url)

    async def delete(self, principal: Principal, endpoint_id: str) -> dict[str, Any]:
        principal.require("admin")
        state = self._get(principal, endpoint_id)
        if state.status is EndpointStatus.DRAINING:
            return {"endpoint_id": endpoint_id, "status": EndpointStatus.DRAINING}
        await self._set_status(state, EndpointStatus.DRAINING, None, StatusTrigger.DELETING)
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


def _size_of(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _refuse_unknown_architecture(path: Path) -> None:
    """A local folder whose config names a model nothing here serves is refused at deploy (a
    registry version's files are fetched later: that one fails while provisioning instead).
    Other problems with the files are left to provisioning, which reports them as the status."""
    try:
        detect(path)
    except UnknownArchitecture:
        raise
    except Exception:
        return
