"""Several versions behind one endpoint: a canary beside the stable version, with weights.

The endpoint's row names its stable version; this module keeps the others (`Track`s, one row
each in `endpoint_versions`): a canary, which gets its own replicas and a share of the requests
(`EndpointRoute.weights`), and after a promotion the previous stable version, whose replicas stay
warm at weight 0 for `rollback_grace_s` so that a rollback moves traffic without loading
anything. Verbs: `add` a canary, `set_traffic`, `promote` it, `rollback` (to the stable version
while a canary runs, else to the previous one kept warm). Routing changes first (requests
follow at once), the database after.

Each tick (`tick`) keeps every kept version's replicas running, retires a previous version whose
grace ran out (its replicas drain), and judges the canary against the stable version
(`control/canary.py`): a breach rolls it back with the reason and the numbers, a clean window
moves it to its next progressive step, and step 100 promotes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

from modelyard.config import EngineSettings, PlatformSettings
from modelyard.control.canary import SloPolicy, judge, next_step
from modelyard.control.registry import ResolvedVersion
from modelyard.control.replicas import ReplicaController
from modelyard.control.state import EndpointState, Replica, engine_env
from modelyard.control.version_scaling import (
    VersionLoad,
    canary_autoscaler,
    max_replicas,
    size,
    stable_cap,
)
from modelyard.control.version_tracks import (
    Track,
    TrackState,
    VersionRole,
    canary_status,
    row_of,
    track_from_row,
)
from modelyard.core.errors import Conflict, Invalid
from modelyard.core.routing import ReadVersionStats, RoutingTable
from modelyard.core.status import ReplicaState
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import Endpoint, EndpointVersion

log = logging.getLogger(__name__)


class Versions:
    def __init__(
        self,
        settings: PlatformSettings,
        db: Database,
        routing: RoutingTable,
        replicas: ReplicaController,
    ) -> None:
        self.settings = settings
        self.db = db
        self.routing = routing
        self.replicas = replicas
        self.tracks: dict[str, dict[str, Track]] = {}  # endpoint id -> version id -> track
        # The gateway's per-version outcomes (handed over by the composition root); None: the
        # SLO gate waits.
        self.read_stats: ReadVersionStats | None = None

    # ----- reading -----------------------------------------------------------------------------

    def of(self, state: EndpointState, role: VersionRole) -> Track | None:
        for track in self.tracks.get(state.row.id, {}).values():
            if track.role is role and track.state is TrackState.SERVING:
                return track
        return None

    def stable_cap(self, state: EndpointState) -> int:
        """The most replicas the stable version may run beside the kept versions, so that the
        endpoint's versions together stay within its max_replicas."""
        kept = [
            t
            for t in self.tracks.get(state.row.id, {}).values()
            if t.role is not VersionRole.STABLE and t.state is TrackState.SERVING
        ]
        return stable_cap(state, kept) if kept else max_replicas(state)

    def kept(self, state: EndpointState) -> frozenset[str]:
        """Versions besides the stable one whose replicas stay (a canary, a warm previous)."""
        return frozenset(
            v
            for v, t in self.tracks.get(state.row.id, {}).items()
            if t.role is not VersionRole.STABLE and t.state is TrackState.SERVING
        )

    def view(self, state: EndpointState) -> dict[str, Any]:
        tracks = self.tracks.get(state.row.id, {})
        canary = self.of(state, VersionRole.CANARY)
        return {
            "weights": dict(state.route.weights),
            "canary": None if canary is None else canary_status(canary, state),
            "fallbacks": state.route.fallbacks,
            "items": [t.view(state) for t in tracks.values()],
            "last_rollback": state.row.last_rollback,
        }

    # ----- restart -----------------------------------------------------------------------------

    def restore(self, state: EndpointState, rows: list[EndpointVersion]) -> None:
        """A live endpoint adopted again at a start: its versions and weights as they were (the
        replicas of the kept ones are started by the next tick)."""
        tracks = {
            r.version_id: track_from_row(r, self.settings)
            for r in rows
            if r.state == TrackState.SERVING
        }
        if len(tracks) < 2:
            return
        self.tracks[state.row.id] = tracks
        for track in tracks.values():
            self._engine_for(state, track)
            if track.role is VersionRole.CANARY:
                self._scaled(state, track)
        self.routing.set_weights(state.route, {v: t.weight for v, t in tracks.items()})

    def forget(self, endpoint_id: str) -> None:
        for version_id in self.tracks.pop(endpoint_id, {}):
            self.replicas.version_engine.pop((endpoint_id, version_id), None)

    # ----- verbs -------------------------------------------------------------------------------

    async def add(
        self,
        state: EndpointState,
        version: ResolvedVersion,
        weight: int,
        replicas: int,
        engine: dict[str, Any],
        slo: SloPolicy,
    ) -> Track:
        """A registry version joins the endpoint as its canary with `weight` percent of the
        requests (taken from the stable version); its replicas start with the next tick."""
        if state.row.version_id is None:
            raise Invalid(
                "only endpoints deployed from the registry take canary versions",
                param="model_artifact",
            )
        if self.of(state, VersionRole.CANARY) is not None:
            raise Conflict(
                "this endpoint has a canary already: promote it or roll it back first",
                code="canary_exists",
            )
        if state.rollout_from is not None:
            raise Conflict("a rollout is in progress", code="rollout_in_progress")
        if version.version_id == state.row.version_id:
            raise Invalid("that version is the stable one already", param="model_artifact")
        ceiling = max_replicas(state)
        if replicas > ceiling - 1:
            raise Invalid(
                f"replicas {replicas} does not fit this endpoint's hardware.max_replicas="
                f"{ceiling}: its versions together run at most that many, and the stable version "
                f"keeps one, so a canary may have at most {ceiling - 1}; raise max_replicas "
                "(PATCH hardware) or ask for fewer",
                param="replicas",
                code="above_max_replicas",
            )
        options = {**state.row.engine_options, **engine}
        engine_env(options)  # a bad option is a 400 now
        tracks = self.tracks.setdefault(state.row.id, {})
        previous = tracks.get(version.version_id)
        if previous is not None:  # the warm previous version comes back as the canary
            previous.state = TrackState.RETIRED
            tracks.pop(version.version_id)
        stable = tracks.get(state.row.version_id) or Track(
            state.row.version_id,
            state.row.artifact,
            VersionRole.STABLE,
            100,
            state.desired,
            dict(state.row.engine_options),
            slo,
        )
        tracks[stable.version_id] = stable
        ref = f"{version.model_name}:{version.version}"
        canary = Track(version.version_id, ref, VersionRole.CANARY, weight, replicas, options, slo)
        self._scaled(state, canary)
        tracks[canary.version_id] = canary
        stable.weight = 100 - weight
        self._engine_for(state, canary)
        self._publish_weights(state)
        await self._save(state)
        return canary

    async def set_traffic(self, state: EndpointState, weights: dict[str, int]) -> None:
        """New weights (percent, summing to 100) over the stable version and the canary."""
        tracks = self.tracks.get(state.row.id, {})
        serving = {
            v
            for v, t in tracks.items()
            if t.state is TrackState.SERVING and t.role is not VersionRole.PREVIOUS
        }
        unknown = sorted(set(weights) - serving)
        if unknown or not serving:
            raise Invalid(
                f"weights may name only this endpoint's stable and canary versions "
                f"({', '.join(sorted(serving)) or 'it has no canary'}); not {', '.join(unknown)}",
                param="weights",
            )
        if sum(weights.values()) != 100 or any(w < 0 for w in weights.values()):
            raise Invalid("weights must be percentages that sum to 100", param="weights")
        for version_id in serving:
            tracks[version_id].weight = weights.get(version_id, 0)
            tracks[version_id].weight_since = time.monotonic()
        self._publish_weights(state)
        await self._save(state)

    async def promote(self, state: EndpointState) -> Track:
        """The canary becomes the stable version; the stable one stays warm at weight 0 for
        `rollback_grace_s`."""
        canary = self.of(state, VersionRole.CANARY)
        if canary is None:
            raise Conflict("this endpoint has no canary to promote", code="no_canary")
        if not any(
            r.version_id == canary.version_id and r.state is ReplicaState.READY
            for r in state.replicas
        ):
            raise Conflict("the canary has no replica serving yet", code="canary_not_ready")
        tracks = self.tracks[state.row.id]
        old = tracks[state.row.version_id]
        old.role, old.weight = VersionRole.PREVIOUS, 0
        old.replicas = max(1, sum(r.version_id == old.version_id for r in state.live))
        old.warm_until = repo.now() + timedelta(seconds=self.settings.rollback_grace_s)
        if self.settings.rollback_grace_s <= 0:
            old.state = TrackState.RETIRED
        canary.role, canary.weight = VersionRole.STABLE, 100
        self._engine_for(state, old)
        self._make_stable(state, canary)
        self._publish_weights(state)
        await self._save(state)
        return canary

    async def rollback(
        self, state: EndpointState, reason: str, by: str, numbers: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """All requests to the stable version at once (a canary runs), else back to the
        previous version kept warm since a promotion; nothing is loaded either way."""
        tracks = self.tracks.get(state.row.id, {})
        canary = self.of(state, VersionRole.CANARY)
        previous = self.of(state, VersionRole.PREVIOUS)
        if canary is not None:
            gone, back = canary, tracks[state.row.version_id]
        elif previous is not None:
            gone, back = tracks[state.row.version_id], previous
            self._make_stable(state, previous)
        else:
            raise Conflict(
                "nothing to roll back to: no canary runs and no previous version is warm",
                code="nothing_to_roll_back",
            )
        gone.state, gone.weight = TrackState.ROLLED_BACK, 0
        back.role, back.weight, back.weight_since = VersionRole.STABLE, 100, time.monotonic()
        self._publish_weights(state)  # requests move here, before anything is written
        record = {
            "from_version_id": gone.version_id,
            "from_model_artifact": gone.artifact,
            "to_version_id": back.version_id,
            "to_model_artifact": back.artifact,
            "reason": reason,
            "numbers": numbers or {},
            "by": by,
            "at": int(time.time()),
        }
        state.row.last_rollback = record
        log.warning("endpoint %s rolled back to %s: %s", state.row.id, back.artifact, reason)
        await self._save(state)
        return record

    # ----- the tick ----------------------------------------------------------------------------

    async def tick(self, state: EndpointState) -> tuple[list[Replica], str | None]:
        """Keep the kept versions' replicas, retire a previous version past its grace, judge
        the canary. Returns the replicas to start and what the gate did (None, or an audit
        action: `endpoint.auto_rollback`, `endpoint.auto_promote`, `endpoint.traffic`)."""
        tracks = self.tracks.get(state.row.id)
        if not tracks:
            return [], None
        done = None
        for track in list(tracks.values()):
            expired = track.warm_until is not None and track.warm_until <= repo.now()
            if track.role is VersionRole.PREVIOUS and expired:
                track.state = TrackState.RETIRED
                await self._save(state)
        canary = self.of(state, VersionRole.CANARY)
        if canary is not None:
            done = await self._gate(state, canary)
        starts = [r for t in tracks.values() for r in self._missing(state, t)]
        self._drop_finished(state)
        return starts, done

    async def _gate(self, state: EndpointState, canary: Track) -> str | None:
        if canary.failures >= self.settings.rollout_attempts:
            why = f"the canary failed to start {canary.failures} times ({state.last_error})"
            await self.rollback(state, why, "system")
            return "endpoint.auto_rollback"
        if self.read_stats is None or state.row.version_id is None:
            return None
        # Only this canary's own requests: an earlier run of the same version is not its record.
        window = min(canary.slo.window_s, max(0.001, time.monotonic() - canary.since))
        verdict = judge(
            canary.slo,
            self.read_stats(state.row.id, canary.version_id, window),
            self.read_stats(state.row.id, state.row.version_id, window),
        )
        canary.last_verdict = verdict
        if verdict.breach is not None:
            await self.rollback(state, f"SLO breached: {verdict.breach}", "system", verdict.numbers)
            return "endpoint.auto_rollback"
        clean_window = time.monotonic() - canary.weight_since >= canary.slo.window_s
        step = next_step(canary.slo, canary.weight)
        if not (verdict.judged and clean_window and canary.slo.steps):
            return None
        if step is None or step >= 100:
            await self.promote(state)
            return "endpoint.auto_promote"
        stable = self.tracks[state.row.id][state.row.version_id]
        await self.set_traffic(state, {canary.version_id: step, stable.version_id: 100 - step})
        return "endpoint.traffic"

    def _missing(self, state: EndpointState, track: Track) -> list[Replica]:
        """New replicas a kept version needs (its own count and scaling), with backoff after
        failures; extra ones drain (`control/version_scaling.py`)."""
        if track.role is VersionRole.STABLE or track.state is not TrackState.SERVING:
            return []
        return size(state, track, self.replicas)

    def started(self, state: EndpointState, replica: Replica) -> None:
        """What came of starting one of a kept version's replicas."""
        track = self.tracks.get(state.row.id, {}).get(replica.version_id or "")
        if track is not None and replica.state is ReplicaState.FAILED:
            track.failures += 1

    # ----- helpers ------------------------------------------------------------------------------

    def _drop_finished(self, state: EndpointState) -> None:
        """Forget the versions that left (their replicas drain); back to one version, the
        weights go (every replica is the stable version's again)."""
        tracks = self.tracks.get(state.row.id, {})
        for version_id in [v for v, t in tracks.items() if t.state is not TrackState.SERVING]:
            tracks.pop(version_id)
            self.replicas.version_engine.pop((state.row.id, version_id), None)
        others = any(r.version_id != state.row.version_id for r in state.live)
        if len(tracks) <= 1 and not others:  # weights stay until the others have drained
            self.tracks.pop(state.row.id, None)
            self.routing.set_weights(state.route, {})

    def _publish_weights(self, state: EndpointState) -> None:
        tracks = self.tracks.get(state.row.id, {})
        self.routing.set_weights(
            state.route,
            {v: t.weight for v, t in tracks.items() if t.state is TrackState.SERVING},
        )

    @staticmethod
    def _scaled(state: EndpointState, track: Track) -> None:
        """A canary scales by its own load under the endpoint's policy (none: a fixed count)."""
        if state.autoscaler is not None:
            track.autoscaler = canary_autoscaler(state.autoscaler.policy, track.replicas)
            track.load = VersionLoad(state.autoscaler.policy.metric)

    def _engine_for(self, state: EndpointState, track: Track) -> None:
        """Replicas of `track`'s version start with its engine options."""
        env, _ = engine_env(track.engine)
        self.replicas.version_engine[(state.row.id, track.version_id)] = env

    def _make_stable(self, state: EndpointState, track: Track) -> None:
        """The endpoint's own version (what its autoscaled replicas run) becomes `track`'s."""
        row = state.row
        row.version_id, row.artifact, row.good_version_id = (
            track.version_id, track.artifact, track.version_id,
        )  # fmt: skip
        row.engine_options = dict(track.engine)
        state.engine_env, _ = engine_env(track.engine)
        state.engine = EngineSettings(**{**self.settings.worker_engine, **track.engine})
        state.clear_failures()
        self.replicas.version_engine.pop((row.id, track.version_id), None)
        self.routing.set_version(state.route, track.version_id)

    async def _save(self, state: EndpointState) -> None:
        """The endpoint's versions and its row's version fields, in one transaction."""
        row = state.row
        tracks = list(self.tracks.get(row.id, {}).values())

        def write() -> None:
            with self.db.session() as s:
                stored = s.get(Endpoint, row.id)
                if stored is None:
                    return
                stored.version_id, stored.artifact = row.version_id, row.artifact
                stored.good_version_id, stored.engine_options = (
                    row.good_version_id, row.engine_options,
                )  # fmt: skip
                stored.last_rollback = row.last_rollback
                for t in tracks:
                    s.merge(row_of(row.id, t))

        await asyncio.to_thread(write)
