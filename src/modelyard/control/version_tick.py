"""Each reconcile tick of an endpoint's versions: the kept versions' replicas are sized, a
previous version past its grace retires, and the gate's decision for the canary
(`control/version_gate.py`) is carried out with the verbs of `Versions` (control/versions.py).
What came of it (`VersionsTick`) goes back to the reconciler, which starts the replicas, writes
a status through the one writer and records the gate's move in the audit log."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from modelyard.config import PlatformSettings
from modelyard.control.audit import AuditAction
from modelyard.control.endpoint_status import StatusChange
from modelyard.control.replicas import ReplicaController
from modelyard.control.state import EndpointState, Replica
from modelyard.control.version_gate import Decision, Move, decide
from modelyard.control.version_scaling import size
from modelyard.control.version_tracks import Track, TrackState, VersionRole
from modelyard.control.versions import Versions
from modelyard.core.status import EndpointStatus, StatusTrigger

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionsTick:
    """What a tick of an endpoint's versions came to, for the reconciler to act on."""

    starts: list[Replica] = field(default_factory=list)  # replicas of kept versions to start
    action: AuditAction | None = None  # what the gate did, recorded as the platform's doing
    status: StatusChange | None = None  # a status the endpoint takes (a rollout fell back)
    reason: str | None = None  # why the gate rolled back, for the audit event


class VersionTicker:
    def __init__(
        self, settings: PlatformSettings, versions: Versions, replicas: ReplicaController
    ) -> None:
        self.settings = settings
        self.versions = versions
        self.replicas = replicas

    async def tick(self, state: EndpointState) -> VersionsTick:
        """Keep the kept versions' replicas, retire a previous version past its grace, carry
        out the gate's decision for the canary."""
        if not self.versions.tracks_of(state):
            return VersionsTick()
        await self.versions.retire_expired(state)
        done = VersionsTick()
        canary = self.versions.of(state, VersionRole.CANARY)
        if canary is not None:
            attempts = self.settings.rollout_attempts
            decision = decide(state, canary, attempts, self.versions.read_stats)
            done = await self._carry_out(state, canary, decision)
        tracks = list(self.versions.tracks_of(state).values())
        starts = [r for t in tracks for r in self._missing(state, t)]
        self.versions.drop_finished(state)
        return VersionsTick(starts, done.action, done.status, done.reason)

    async def _carry_out(self, state: EndpointState, canary: Track, d: Decision) -> VersionsTick:
        if d.verdict is not None:
            canary.last_verdict = d.verdict
        if d.move is Move.ROLL_BACK:
            await self.versions.rollback(state, d.reason, "system", d.numbers)
            return VersionsTick(action=AuditAction.ENDPOINT_AUTO_ROLLBACK, reason=d.reason)
        if d.move is Move.FALL_BACK:  # the same rollback; the endpoint says so in its status
            log.warning("endpoint %s: %s", state.row.id, d.reason)
            await self.versions.rollback(state, d.reason, "system")
            status = StatusChange(EndpointStatus.DEGRADED, d.reason, StatusTrigger.ROLLED_BACK)
            return VersionsTick(
                action=AuditAction.ENDPOINT_ROLLOUT_FALLBACK, status=status, reason=d.reason
            )
        if d.move is Move.PROMOTE:
            await self.versions.promote(state)
            # A rollout's promotion ends it: audited once, as `endpoint.rollout` when it began.
            promoted = None if canary.slo.rollout else AuditAction.ENDPOINT_AUTO_PROMOTE
            return VersionsTick(action=promoted)
        if d.move is Move.STEP:
            stable = state.row.version_id or ""
            weights = {canary.version_id: d.weight, stable: 100 - d.weight}
            await self.versions.set_traffic(state, weights)
            return VersionsTick(action=AuditAction.ENDPOINT_TRAFFIC)
        return VersionsTick()

    def _missing(self, state: EndpointState, track: Track) -> list[Replica]:
        """New replicas a kept version needs (its own count and scaling), with backoff after
        failures; extra ones drain (`control/version_scaling.py`)."""
        if track.role is VersionRole.STABLE or track.state is not TrackState.SERVING:
            return []
        return size(state, track, self.replicas)
