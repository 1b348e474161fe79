"""An endpoint's versions as the control plane keeps them (`Track`), their rows in
`endpoint_versions` (read and written), and their views; the verbs that change them are
`control/versions.py`'s."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from modelyard.config import PlatformSettings
from modelyard.control.autoscaler import Autoscaler
from modelyard.control.canary import SloPolicy, Verdict, next_step
from modelyard.control.state import EndpointState
from modelyard.core.status import ReplicaState
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import Endpoint, EndpointVersion

if TYPE_CHECKING:
    from modelyard.control.version_load import VersionLoad


class VersionRole(StrEnum):
    STABLE = "stable"
    CANARY = "canary"
    PREVIOUS = "previous"  # the stable version before a promotion, kept warm at weight 0


class TrackState(StrEnum):
    SERVING = "serving"
    ROLLED_BACK = "rolled_back"
    RETIRED = "retired"


@dataclass(eq=False)
class Track:
    version_id: str
    artifact: str  # NAME:VERSION
    role: VersionRole
    weight: int
    replicas: int  # a canary's floor, a previous version's count (the stable's: the endpoint's)
    engine: dict[str, Any]  # its engine options (the endpoint's, with a canary's overrides)
    slo: SloPolicy
    created_at: datetime = field(default_factory=repo.now)
    warm_until: datetime | None = None
    state: TrackState = TrackState.SERVING
    weight_since: float = field(default_factory=time.monotonic)  # for progressive steps
    since: float = field(default_factory=time.monotonic)  # judged on requests from here on
    failures: int = 0  # replica starts that failed since one last served
    next_start_at: float = 0.0
    last_verdict: Verdict | None = None
    # A canary's own autoscaling (`control/version_scaling.py`); None: it keeps `replicas`.
    autoscaler: Autoscaler | None = None
    load: VersionLoad | None = None
    desired: int = 0  # what it should run now (0: not sized yet, `replicas`)

    def view(self, state: EndpointState) -> dict[str, Any]:
        mine = [r for r in state.live if r.version_id == self.version_id]
        return {
            "version_id": self.version_id,
            "model_artifact": self.artifact,
            "role": self.role,
            "weight": self.weight,
            "state": self.state,
            "replicas": {
                "desired": state.desired
                if self.role is VersionRole.STABLE
                else (self.desired or self.replicas),
                "min": self.replicas if self.role is not VersionRole.STABLE else None,
                "ready": sum(r.state is ReplicaState.READY for r in mine),
                "live": len(mine),
            },
            "autoscaling": None
            if self.autoscaler is None or self.autoscaler.last is None
            else self.autoscaler.last.view(),
            "engine": self.engine,
            "slo": self.slo.view(),
            "warm_until": int(self.warm_until.timestamp()) if self.warm_until else None,
            "last_check": None
            if self.last_verdict is None
            else {"judged": self.last_verdict.judged, **self.last_verdict.numbers},
        }


def track_from_row(r: EndpointVersion, settings: PlatformSettings) -> Track:
    return Track(
        version_id=r.version_id,
        artifact=r.artifact,
        role=VersionRole(r.role),
        weight=r.weight,
        replicas=r.replicas,
        engine=dict(r.engine_options),
        slo=SloPolicy.from_json(r.slo, settings),
        created_at=r.created_at,
        warm_until=r.warm_until,
    )


def row_of(endpoint_id: str, t: Track) -> EndpointVersion:
    return EndpointVersion(
        endpoint_id=endpoint_id,
        version_id=t.version_id,
        artifact=t.artifact,
        role=t.role.value,
        weight=t.weight,
        replicas=t.replicas,
        engine_options=t.engine,
        slo=t.slo.view(),
        state=t.state.value,
        warm_until=t.warm_until,
        created_at=t.created_at,
        updated_at=repo.now(),
    )


def canary_status(canary: Track, state: EndpointState) -> dict[str, Any]:
    ready = any(
        r.version_id == canary.version_id and r.state is ReplicaState.READY for r in state.replicas
    )
    return {
        "version_id": canary.version_id,
        "model_artifact": canary.artifact,
        "weight": canary.weight,
        "status": "serving" if ready else ("failing" if canary.failures else "starting"),
        "next_step": next_step(canary.slo, canary.weight) if canary.slo.steps else None,
    }


def save_versions(db: Database, row: Endpoint, tracks: list[Track]) -> None:
    """The endpoint's versions and its row's version fields, in one transaction (blocking)."""
    with db.session() as s:
        stored = s.get(Endpoint, row.id)
        if stored is None:
            return
        stored.version_id, stored.artifact = row.version_id, row.artifact
        stored.good_version_id, stored.engine_options = row.good_version_id, row.engine_options
        stored.last_rollback = row.last_rollback
        for t in tracks:
            s.merge(row_of(row.id, t))
