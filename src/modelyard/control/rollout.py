"""Versions of an endpoint: rolling out another registry version, remembering the last version
that served, and falling back to it when a rollout's version keeps failing to load.

The replicas of the old version serve until the new version's are ready (`ReplicaController
.converge`); this module only moves the endpoint's version and says which status that brings.
"""

from __future__ import annotations

import asyncio
import logging

from modelyard.config import PlatformSettings
from modelyard.control.endpoint_status import StatusChange
from modelyard.control.registry import Registry, ResolvedVersion
from modelyard.control.state import EndpointState
from modelyard.core.routing import RoutingTable
from modelyard.core.status import EndpointStatus, ReplicaState, StatusTrigger
from modelyard.store.db import Database
from modelyard.store.tables import Endpoint

log = logging.getLogger(__name__)


class Rollouts:
    def __init__(
        self, settings: PlatformSettings, db: Database, registry: Registry, routing: RoutingTable
    ) -> None:
        self.settings = settings
        self.db = db
        self.registry = registry
        self.routing = routing

    async def start(self, state: EndpointState, version: ResolvedVersion) -> StatusChange:
        """Point the endpoint at `version`; its replicas are started by the next reconcile."""
        ref = f"{version.model_name}:{version.version}"
        state.rollout_from = state.row.version_id
        await asyncio.to_thread(self._write_version, state, version.version_id, ref)
        state.clear_failures()
        state.next_restart_at = 0.0
        return StatusChange(
            EndpointStatus.ROLLING_OUT, f"rolling out {ref}", StatusTrigger.ROLLOUT_STARTED
        )

    def _write_version(self, state: EndpointState, version_id: str | None, artifact: str) -> None:
        with self.db.session() as s:
            row = s.get(Endpoint, state.row.id)
            assert row is not None
            row.version_id, row.artifact = version_id, artifact
        state.row.version_id, state.row.artifact = version_id, artifact
        self.routing.set_version(state.route, version_id)

    async def mark_good(self, state: EndpointState) -> None:
        """The endpoint's version serves: it is what a failing rollout will fall back to."""

        def write() -> None:
            with self.db.session() as s:
                row = s.get(Endpoint, state.row.id)
                if row is not None:
                    row.good_version_id = state.row.version_id

        state.row.good_version_id = state.row.version_id
        await asyncio.to_thread(write)

    async def maybe_roll_back(self, state: EndpointState) -> StatusChange | None:
        """A version that failed to load `rollout_attempts` times in a row, with none of its
        replicas ever ready, gives way to the last good version (the spec's tier 3): the
        endpoint is pointed back at it, and the change says so."""
        good = state.row.good_version_id
        failed_version = state.row.version_id
        if (
            good is None
            or good == failed_version
            or state.failures < self.settings.rollout_attempts
            or any(r.state is ReplicaState.READY for r in state.current)
        ):
            return None
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
        return StatusChange(EndpointStatus.DEGRADED, message, StatusTrigger.ROLLED_BACK)
