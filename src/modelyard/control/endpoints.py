"""Endpoints: deploy a model version as replicas, roll it to another version, read and delete.

The database holds what should exist (the endpoint rows); this manager holds what does exist
(replica processes via a backend). It builds its collaborators and its verbs are short: each
checks the caller, then hands the work to the one whose job it is: `deploy` (validation),
`Provisioner` (`endpoint_provision`: adopt a row, start its replicas, drain them on delete),
`Reconciler` (`reconcile`: the loop that keeps replicas matching what should run),
`EndpointStatuses` (`endpoint_status`: the one writer of statuses) and `endpoint_view` (the
JSON the API shows). On start it re-provisions every live endpoint in the database, with its
versions. The version verbs (`VersionVerbs` in `endpoint_versions`: rollout, canary, traffic,
promote, rollback, reconfigure; the work itself in `versions`) are built here and called by
the API directly. A cluster's new leader hands it a `ReplicaTakeover` (`takeover`): the
replicas its predecessor left running are adopted, not started again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from modelyard.config import PlatformSettings
from modelyard.control import adapters, endpoint_config
from modelyard.control import deploy as validation
from modelyard.control.audit import AuditLog
from modelyard.control.backends.base import Backend
from modelyard.control.draft_check import check_draft_model
from modelyard.control.encoder_pool import EncoderPool
from modelyard.control.endpoint_provision import Provisioner
from modelyard.control.endpoint_status import EndpointStatuses
from modelyard.control.endpoint_versions import VersionVerbs
from modelyard.control.endpoint_view import endpoint_view
from modelyard.control.owner_heartbeat import OwnerHeartbeat
from modelyard.control.reconcile import Reconciler
from modelyard.control.registry import Registry
from modelyard.control.replicas import ReplicaController
from modelyard.control.state import EndpointState, spawn
from modelyard.control.takeover import ReplicaTakeover
from modelyard.control.versions import Versions
from modelyard.core.errors import Conflict, NotFound
from modelyard.core.identity import Principal
from modelyard.core.roles import DEPLOYERS
from modelyard.core.routing import RoutingTable
from modelyard.core.status import EndpointStatus, StatusTrigger
from modelyard.protocol.management import DeployRequest
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import Endpoint, EndpointVersion

log = logging.getLogger(__name__)


class EndpointManager:
    def __init__(
        self,
        settings: PlatformSettings,
        db: Database,
        registry: Registry,
        backend: Backend,
        routing: RoutingTable,
        audit: AuditLog | None = None,
        takeover: ReplicaTakeover | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.registry = registry
        self.backend = backend
        self.routing = routing
        self.endpoints: dict[str, EndpointState] = {}
        self.takeover = takeover
        self.replicas = ReplicaController(settings, backend, routing, registry, self.endpoints)
        self.encoders = EncoderPool(settings, backend, self.replicas.placement, routing)
        if takeover is not None:  # a new leader keeps the running encoder host
            takeover.adopt_encoder_host = self.encoders.adopt
        self.node_cache = self.replicas.node_cache
        self.warm_pool = self.replicas.warm_pool
        self.statuses = EndpointStatuses(db, routing)
        self.versions = Versions(settings, db, routing, self.replicas)
        self.reconciler = Reconciler(
            settings, self.endpoints, self.replicas, self.encoders, self.statuses, routing,
            self.versions, audit,
        )  # fmt: skip
        self.provisioner = Provisioner(
            settings, backend, routing, self.endpoints, self.replicas, self.encoders,
            self.statuses, self.versions, self.reconciler, takeover,
        )  # fmt: skip
        self.refused = self.provisioner.refused
        # Cluster mode: the replicas this leader owns hear from it, or exit in time.
        self.heartbeat = OwnerHeartbeat(
            settings, backend, takeover.pending_urls if takeover is not None else list
        )
        # The version verbs, which the API's routes call directly.
        self.version_verbs = VersionVerbs(
            settings,
            db,
            registry,
            self.statuses,
            self.versions,
            self.reconciler,
            self._get,
            self.refused,
        )

    # ----- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self.takeover is not None:  # held back from publishing before any entry is written
            self.takeover.hold_back()
        self.heartbeat.start()  # adopted replicas hear from their new owner as soon as adopted

        def load() -> list[tuple[Endpoint, list[EndpointVersion]]]:
            with self.db.session() as s:
                return [
                    (row, list(repo.endpoint_versions(s, row.id))) for row in repo.live_endpoints(s)
                ]

        for row, versions in await asyncio.to_thread(load):
            if row.status == EndpointStatus.DRAINING.value:  # interrupted delete: finish it
                await self.statuses.deleted(row.id)
                continue
            # Nothing stored may stop the start: a row that no longer parses is refused alone.
            try:
                config = endpoint_config.parse(
                    self.settings, row.hardware, row.scaling, row.engine_options,
                    row.sampling_defaults, stored=True,
                )  # fmt: skip
            except Exception as exc:
                await self.provisioner.refuse_stored(row, str(exc) or type(exc).__name__)
                continue
            state = self.provisioner.adopt(row, config)
            try:
                self.versions.restore(state, versions)
            except Exception:  # its canary's stored options: the stable version serves alone
                log.exception("endpoint %s: its versions are not restored", row.id)
                self.versions.forget(row.id)
        if self.takeover is not None:
            await self.takeover.stop_orphans(set(self.endpoints) - self.refused)
        self.reconciler.start()

    async def stop(self) -> None:
        self.reconciler.stop()
        await self.heartbeat.stop()
        for state in self.endpoints.values():
            for task in state.tasks:
                task.cancel()
        await self.replicas.close()
        await self.backend.stop_all()
        await self.encoders.close()
        self.reconciler.save_history()

    # ----- deploy ----------------------------------------------------------------------------

    async def deploy(self, principal: Principal, req: DeployRequest) -> dict[str, Any]:
        validation.check_request(principal, req, self.settings)
        validation.check_engine_paths(self.settings, principal, req.engine)
        # Everything the endpoint will run with, before anything is written.
        config = endpoint_config.parse(
            self.settings, req.hardware, req.scaling, req.engine, req.sampling_defaults
        )
        path, version = await asyncio.to_thread(
            validation.resolve_artifact, self.settings, self.registry, principal, req.model_artifact
        )
        await asyncio.to_thread(
            check_draft_model, self.settings, principal, req.engine, self.registry, path, version
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
        state = self.provisioner.adopt(row, config, path)
        return {
            "endpoint_id": row.id,
            "status": state.status,
            "estimated_ready_seconds": validation.estimated_ready_seconds(path, version),
        }

    async def adapters_changed(self, tenant_id: str) -> None:
        """A LoRA adapter was pushed: the endpoints serving its base (the tenant's own, and
        public ones) serve it now (their adapter folders synced; `control/adapters.py`)."""
        for state in list(self.endpoints.values()):
            mine = state.row.tenant_id == tenant_id or state.row.public
            if mine and adapters.serves_adapters(state):
                names = await asyncio.to_thread(
                    adapters.sync, self.registry, self.replicas.node_cache, state
                )
                self.routing.set_adapters(state.route, names)

    def activate(self, endpoint_id: str) -> None:
        """The gateway's verb (handed to it by the composition root): a request arrived for
        `endpoint_id` while no replica serves it."""
        state = self.endpoints.get(endpoint_id)
        if state is not None:
            self.reconciler.activate(state)

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
            self._view(s, base_url)
            for s in self.endpoints.values()
            if principal.platform_admin or s.row.tenant_id == principal.tenant_id
        ]

    def get(self, principal: Principal, endpoint_id: str, base_url: str) -> dict[str, Any]:
        return self._view(self._get(principal, endpoint_id), base_url)

    def _view(self, state: EndpointState, base_url: str) -> dict[str, Any]:
        return {**endpoint_view(state, base_url), "versions": self.versions.view(state)}

    async def delete(self, principal: Principal, endpoint_id: str) -> dict[str, Any]:
        principal.require_any(DEPLOYERS)
        state = self._get(principal, endpoint_id)
        if state.status is EndpointStatus.DRAINING:
            return {"endpoint_id": endpoint_id, "status": EndpointStatus.DRAINING}
        await self.statuses.set(state, EndpointStatus.DRAINING, None, StatusTrigger.DELETING)
        self.routing.remove(endpoint_id)  # no new requests from here on
        self.versions.forget(endpoint_id)
        spawn(state, self.provisioner.drain_and_stop(state))
        return {"endpoint_id": endpoint_id, "status": EndpointStatus.DRAINING}

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
