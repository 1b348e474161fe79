"""Endpoint changes that keep the endpoint: a rollout to another version, a canary beside the
stable version (add, traffic, promote, rollback) and new sampling defaults or scaling.

Built by `EndpointManager` (control/endpoints.py), which hands it its lookup of a caller's
endpoint; the API's routes call these verbs directly. Each checks the caller, then hands the
work to `Versions` (control/versions.py), where every version change happens: a rollout is a
canary at 100 % promoted as soon as it serves, and a rollback is one path for all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from modelyard.config import PlatformSettings
from modelyard.control import deploy as validation
from modelyard.control import endpoint_config
from modelyard.control.autoscaler import Autoscaler
from modelyard.control.canary import SloPolicy
from modelyard.control.draft_check import check_draft_model
from modelyard.control.endpoint_status import EndpointStatuses, StatusChange
from modelyard.control.model_kind import LLM
from modelyard.control.reconcile import Reconciler
from modelyard.control.registry import Registry
from modelyard.control.scaling import LoadTracker
from modelyard.control.state import EndpointState
from modelyard.control.versions import Versions
from modelyard.core.errors import Invalid
from modelyard.core.identity import Principal
from modelyard.core.roles import DEPLOYERS
from modelyard.core.status import EndpointStatus, StatusTrigger
from modelyard.protocol.management import SamplingDefaults, Scaling
from modelyard.store.db import Database
from modelyard.store.tables import Endpoint


class VersionVerbs:
    def __init__(
        self,
        settings: PlatformSettings,
        db: Database,
        registry: Registry,
        statuses: EndpointStatuses,
        versions: Versions,
        reconciler: Reconciler,
        find: Callable[[Principal, str], EndpointState],
        refused: set[str],
    ) -> None:
        self.settings = settings
        self.db = db
        self.registry = registry
        self.statuses = statuses
        self.versions = versions
        self.reconciler = reconciler
        self._get = find  # the manager's: the caller's endpoint, or NotFound
        self.refused = refused  # stored endpoints whose configuration did not parse: delete only

    def _changeable(self, principal: Principal, endpoint_id: str) -> EndpointState:
        """The endpoint a verb changes; one refused at the start takes no change but delete."""
        state = self._get(principal, endpoint_id)
        if endpoint_id in self.refused:
            raise Invalid(
                f"endpoint {endpoint_id!r} was not started: {state.message}",
                param="endpoint_id",
                code="endpoint_config_invalid",
            )
        return state

    async def update(self, principal: Principal, endpoint_id: str, artifact: str) -> dict[str, Any]:
        """Roll the endpoint out to another registry version (`Versions.roll_out`: a canary at
        100 % promoted as soon as it serves). Its replicas keep serving until the new version's
        are; if those fail to load, the endpoint falls back."""
        principal.require_any(DEPLOYERS)
        state = self._changeable(principal, endpoint_id)
        if state.kind not in (None, LLM):
            raise Invalid(
                "encoder endpoints are updated by deploying again", param="model_artifact"
            )
        version = await asyncio.to_thread(self.registry.resolve, principal.tenant_id, artifact)
        assert version is not None
        if await self.versions.roll_out(state, version, principal.key_id or "system"):
            ref = f"{version.model_name}:{version.version}"
            started = StatusChange(
                EndpointStatus.ROLLING_OUT, f"rolling out {ref}", StatusTrigger.ROLLOUT_STARTED
            )
            await self.statuses.apply(state, started)
            self.reconciler.poke(state)
        else:
            await self.statuses.refresh(state)
        status = state.status
        return {"endpoint_id": endpoint_id, "status": status, "version_id": version.version_id}

    async def add_version(
        self,
        principal: Principal,
        endpoint_id: str,
        artifact: str,
        weight: int,
        replicas: int,
        engine: dict[str, Any],
        slo: dict[str, Any] | None,
        steps: list[int] | None,
    ) -> dict[str, Any]:
        """A registry version joins the endpoint as a canary with `weight` percent of its
        requests (see `control/versions.py`)."""
        principal.require_any(DEPLOYERS)
        validation.check_engine_paths(self.settings, principal, engine)
        state = self._llm(principal, endpoint_id)
        policy = SloPolicy.from_request(self.settings, slo, steps)
        version = await asyncio.to_thread(self.registry.resolve, principal.tenant_id, artifact)
        assert version is not None
        await asyncio.to_thread(
            check_draft_model, self.settings, principal, engine, self.registry, None, version
        )
        await self.versions.add(state, version, weight, replicas, engine, policy)
        self.reconciler.poke(state)
        return self.versions.view(state)

    async def set_traffic(
        self, principal: Principal, endpoint_id: str, weights: dict[str, int]
    ) -> dict[str, Any]:
        principal.require_any(DEPLOYERS)
        state = self._llm(principal, endpoint_id)
        await self.versions.set_traffic(state, weights)
        return self.versions.view(state)

    async def promote(self, principal: Principal, endpoint_id: str) -> dict[str, Any]:
        principal.require_any(DEPLOYERS)
        state = self._llm(principal, endpoint_id)
        await self.versions.promote(state)
        self.reconciler.poke(state)
        return self.versions.view(state)

    async def rollback(
        self, principal: Principal, endpoint_id: str, reason: str | None
    ) -> dict[str, Any]:
        """All traffic back at once, to replicas that already run (see `Versions.rollback`)."""
        principal.require_any(DEPLOYERS)
        state = self._llm(principal, endpoint_id)
        started = time.perf_counter()
        record = await self.versions.rollback(
            state, reason or "manual rollback", principal.key_id or "system"
        )
        await self.statuses.refresh(state)  # a rollout rolled back no longer rolls out
        self.reconciler.poke(state)
        return {
            **self.versions.view(state),
            # where requests go from now on; the view's own weights may already be empty,
            # since a tick that ran meanwhile forgot the version that left (one version again)
            "weights": {record["to_version_id"]: 100},
            "rollback": record,
            "took_ms": round((time.perf_counter() - started) * 1000, 1),
        }

    async def reconfigure(
        self,
        principal: Principal,
        endpoint_id: str,
        sampling: SamplingDefaults | None,
        scaling: Scaling | None,
    ) -> None:
        """New sampling defaults (the next request gets them) or scaling policy (the next
        tick's decision follows it), without a rollout."""
        principal.require_any(DEPLOYERS)
        state = self._changeable(principal, endpoint_id)
        row = state.row
        # The new policy is built before anything changes: a bad one changes nothing.
        policy = None if scaling is None else endpoint_config.parse_scaling(row.hardware, scaling)
        if sampling is not None:
            row.sampling_defaults = sampling.model_dump(exclude_none=True)
            state.route.sampling_defaults = dict(row.sampling_defaults)
        if scaling is not None and policy is not None:
            row.scaling = scaling.model_dump()
            state.autoscaler = Autoscaler(policy)
            state.load = LoadTracker(policy.metric)

        def write() -> None:
            with self.db.session() as s:
                stored = s.get(Endpoint, row.id)
                if stored is not None:
                    stored.sampling_defaults, stored.scaling = row.sampling_defaults, row.scaling

        await asyncio.to_thread(write)

    def _llm(self, principal: Principal, endpoint_id: str) -> EndpointState:
        state = self._changeable(principal, endpoint_id)
        if state.kind not in (None, LLM) or state.status in (
            EndpointStatus.DRAINING,
            EndpointStatus.DELETED,
        ):
            raise Invalid("only a live LLM endpoint serves several versions", param="endpoint_id")
        return state
