"""Every change of an endpoint's version goes through here: a canary beside the stable version,
and a rollout, which is a canary at 100 % promoted as soon as it serves.

The endpoint's row names its stable version; this module keeps the others (`Track`s, one row
each in `endpoint_versions`): a canary, which gets its own replicas and a share of the requests
(`EndpointRoute.weights`), and after a promotion the previous stable version, whose replicas stay
warm at weight 0 for `rollback_grace_s` so that a rollback moves traffic without loading
anything. Verbs: `add` a canary (with a rollout's policy, `roll_out`: every replica of the
stable version serves until the canary has one serving, it surges beside them to the endpoint's
own count, and its promotion retires them rather than keeping them warm), `set_traffic`,
`promote` it, `rollback`. A rollback is one path for all: the manual one, the SLO gate's, a
canary that cannot start and a rollout that cannot (its fallback); it goes to the stable version
while a canary runs, else to the previous one kept warm. Routing changes first (requests
follow at once), the database after.

The tick that keeps the kept versions' replicas and carries out the gate's decisions is
`control/version_tick.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

from modelyard.config import EngineSettings, PlatformSettings
from modelyard.control.canary import SloPolicy
from modelyard.control.registry import ResolvedVersion
from modelyard.control.replicas import ReplicaController
from modelyard.control.state import EndpointState, Replica, VersionRef, engine_env
from modelyard.control.version_load import VersionLoad
from modelyard.control.version_scaling import canary_autoscaler, max_replicas
from modelyard.control.version_scaling import stable_cap as cap_beside
from modelyard.control.version_tracks import (
    Track,
    TrackState,
    VersionRole,
    canary_status,
    save_versions,
    track_from_row,
)
from modelyard.core.errors import Conflict, Invalid
from modelyard.core.routing import ReadVersionStats, RoutingTable
from modelyard.core.status import ReplicaState
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import EndpointVersion

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

    def _others(self, state: EndpointState) -> dict[str, Track]:
        """The kept versions besides the stable one (a canary, a warm previous)."""
        return {
            v: t
            for v, t in self.tracks.get(state.row.id, {}).items()
            if t.role is not VersionRole.STABLE and t.state is TrackState.SERVING
        }

    def stable_cap(self, state: EndpointState) -> int:
        """The most replicas the stable version may run beside the kept versions, so that the
        endpoint's versions together stay within its max_replicas (a rollout surges above it:
        the stable version keeps all of its replicas until the new version serves)."""
        kept = [t for t in self._others(state).values() if not t.slo.rollout]
        return cap_beside(state, kept) if kept else max_replicas(state)

    def kept(self, state: EndpointState) -> frozenset[str]:
        """Versions besides the stable one whose replicas stay (a canary, a warm previous)."""
        return frozenset(self._others(state))

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
            if track.role is VersionRole.CANARY and track.slo.rollout:
                state.rollout_to = VersionRef(track.version_id, track.artifact)
            elif track.role is VersionRole.CANARY:
                self._scaled(state, track)
        self._publish_weights(state)

    def forget(self, endpoint_id: str) -> None:
        for version_id in self.tracks.pop(endpoint_id, {}):
            self.replicas.version_engine.pop((endpoint_id, version_id), None)

    # ----- verbs -------------------------------------------------------------------------------

    async def roll_out(self, state: EndpointState, version: ResolvedVersion, by: str) -> bool:
        """The whole endpoint to `version`: added as a canary at 100 % that is promoted as soon
        as it serves (`add` with a rollout's policy); a rollout in progress gives way to it, and
        asked for the stable version it is rolled back. Whether a rollout now runs."""
        if version.version_id == state.row.version_id:
            if state.rollout_to is not None:
                await self.rollback(state, "rolled out to the stable version again", by)
            return False
        if state.rollout_to is not None and version.version_id == state.rollout_to.version_id:
            return True
        replicas = max(1, state.desired)  # a scaled-to-zero endpoint loads it once to prove it
        await self.add(state, version, 100, replicas, {}, SloPolicy.for_rollout(self.settings))
        return True

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
                "only endpoints deployed from the registry change versions: deploy the "
                "registry version as an endpoint of its own",
                param="model_artifact",
            )
        running = self.of(state, VersionRole.CANARY)
        if running is not None and running.slo.rollout and not slo.rollout:
            raise Conflict("a rollout is in progress", code="rollout_in_progress")
        if running is not None and not running.slo.rollout:
            raise Conflict(
                "a canary runs on this endpoint: promote it or roll it back first",
                code="canary_exists",
            )
        if version.version_id == state.row.version_id:
            raise Invalid("that version is the stable one already", param="model_artifact")
        ceiling = max_replicas(state)
        if not slo.rollout and replicas > ceiling - 1:
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
        for other in list(tracks.values()):
            # A rollout in progress gives way; a rollout replaces every version but the stable
            # one (a previous one kept warm drains); the warm previous version comes back as
            # the canary.
            replaced = other.role is VersionRole.CANARY or (
                other.role is VersionRole.PREVIOUS
                and (slo.rollout or other.version_id == version.version_id)
            )
            if replaced:
                other.state = TrackState.RETIRED
        tracks.pop(version.version_id, None)
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
        if not slo.rollout:  # a rollout runs the endpoint's own count
            self._scaled(state, canary)
        tracks[canary.version_id] = canary
        stable.weight = 100 - weight
        state.rollout_to = VersionRef(version.version_id, ref) if slo.rollout else None
        self._engine_for(state, canary)
        self._publish_weights(state)
        await self._save(state)
        return canary

    async def set_traffic(self, state: EndpointState, weights: dict[str, int]) -> None:
        """New weights (percent, summing to 100) over the stable version and the canary."""
        if state.rollout_to is not None:
            raise Conflict("a rollout is in progress", code="rollout_in_progress")
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
        `rollback_grace_s` (after a rollout it drains once the new version's replicas serve)."""
        canary = self.of(state, VersionRole.CANARY)
        if canary is None:
            raise Conflict("this endpoint has no canary to promote", code="no_canary")
        if not any(
            r.version_id == canary.version_id and r.state is ReplicaState.READY
            for r in state.replicas
        ):
            raise Conflict("the canary has no replica serving yet", code="canary_not_ready")
        tracks = self.tracks[state.row.id]
        assert state.row.version_id is not None  # an endpoint with a canary has a stable one
        old = tracks[state.row.version_id]
        old.role, old.weight = VersionRole.PREVIOUS, 0
        old.replicas = max(1, sum(r.version_id == old.version_id for r in state.live))
        old.warm_until = repo.now() + timedelta(seconds=self.settings.rollback_grace_s)
        if self.settings.rollback_grace_s <= 0 or canary.slo.rollout:
            old.state = TrackState.RETIRED
        canary.role, canary.weight = VersionRole.STABLE, 100
        self._engine_for(state, old)
        self._make_stable(state, canary)
        if canary.slo.rollout:  # the old replicas serve on until the new ones all do
            state.rollout_to = None
            self.routing.set_weights(state.route, {})
        else:
            self._publish_weights(state)
        await self._save(state)
        return canary

    async def rollback(
        self, state: EndpointState, reason: str, by: str, numbers: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """All requests to the stable version at once (a canary or a rollout runs), else back
        to the previous version kept warm since a promotion; nothing is loaded either way.
        Returns what is kept as the endpoint's `last_rollback`."""
        tracks = self.tracks.get(state.row.id, {})
        canary = self.of(state, VersionRole.CANARY)
        previous = self.of(state, VersionRole.PREVIOUS)
        stable_id = state.row.version_id or ""  # a deployed endpoint always has one
        if canary is not None:
            gone, back = canary, tracks[stable_id]
        elif previous is not None:
            gone, back = tracks[stable_id], previous
            self._make_stable(state, previous)
        else:
            raise Conflict(
                "nothing to roll back to: no canary runs and no previous version is warm",
                code="nothing_to_roll_back",
            )
        gone.state, gone.weight = TrackState.ROLLED_BACK, 0
        back.role, back.weight, back.weight_since = VersionRole.STABLE, 100, time.monotonic()
        state.rollout_to = None
        state.clear_failures()  # the version that failed is gone: no backoff for the one back
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

    async def mark_good(self, state: EndpointState) -> None:
        """The endpoint's version serves: it is what a failing rollout falls back to."""
        state.row.good_version_id = state.row.version_id
        await self._save(state)

    # ----- what the tick asks (`control/version_tick.py`) ----------------------------------------

    def tracks_of(self, state: EndpointState) -> dict[str, Track]:
        return self.tracks.get(state.row.id, {})

    def started(self, state: EndpointState, replica: Replica) -> None:
        """What came of starting one of a kept version's replicas."""
        track = self.tracks.get(state.row.id, {}).get(replica.version_id or "")
        if track is not None and replica.state is ReplicaState.FAILED:
            track.failures += 1

    async def retire_expired(self, state: EndpointState) -> None:
        """A previous version whose grace ran out leaves (its replicas drain)."""
        for track in list(self.tracks.get(state.row.id, {}).values()):
            expired = track.warm_until is not None and track.warm_until <= repo.now()
            if track.role is VersionRole.PREVIOUS and expired:
                track.state = TrackState.RETIRED
                await self._save(state)

    def drop_finished(self, state: EndpointState) -> None:
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

    # ----- helpers ------------------------------------------------------------------------------

    def _publish_weights(self, state: EndpointState) -> None:
        """The serving versions' weights; none while a rollout runs (every replica serves, the
        stable version's until the rollout's canary has one serving)."""
        tracks = self.tracks.get(state.row.id, {})
        weights = {v: t.weight for v, t in tracks.items() if t.state is TrackState.SERVING}
        self.routing.set_weights(state.route, {} if state.rollout_to else weights)

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
        # `<model>:<name>` of its own `lora_dir` passes the gateway (`gateway/admission.py`).
        state.route.lora_dir = state.route.lora_dir or track.engine.get("lora_dir") is not None

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
        tracks = list(self.tracks.get(state.row.id, {}).values())
        await asyncio.to_thread(save_versions, self.db, state.row, tracks)
