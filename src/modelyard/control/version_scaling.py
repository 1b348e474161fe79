"""A canary's own autoscaling: its replicas follow the load its share of the requests brings.

The endpoint's autoscaler (`control/scaling.py`) sizes the stable version on the whole
endpoint's load, on purpose: a rollback sends every request to the stable version at once, so
it must already have the replicas for all of them. A canary gets an `Autoscaler` of its own
with the endpoint's scaling policy, floored at the replicas it was added with and capped at what
the endpoint's `max_replicas` leaves beside one stable replica (never at zero: a canary without
replicas has nothing to judge), fed by what its own replicas carry:

- `concurrency`: requests in flight on its replicas, plus its weight's share of the requests
  queued at the gateway;
- `queue_depth`: that queued share plus the sequences waiting in its engines;
- `gpu_utilization`: its engines' busy fraction since the last tick;
- `requests_per_second`: its weight's share of the endpoint's new requests per second.

A previous version kept warm after a promotion takes no requests and keeps its count.
`size` applies the target: missing replicas are listed for the caller to start (with backoff
after failed starts), extra ones drain as the endpoint's own do.

`max_replicas` bounds the endpoint's replicas of every version together (those draining
included, since they still run): a kept version starts only into the room the others leave
(`room`), and the stable version yields a canary its floor (`stable_cap`), so neither a canary
nor a version kept warm takes the endpoint, or its tenant, past its ceiling.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from modelyard.control.autoscaler import Autoscaler, ScalingPolicy
from modelyard.control.replicas import ReplicaController, scale_down_order
from modelyard.control.state import EndpointState, Replica, spawn
from modelyard.control.version_tracks import VersionRole
from modelyard.core.status import LIVE, ReplicaState
from modelyard.store import repository as repo

if TYPE_CHECKING:
    from modelyard.control.version_tracks import Track

_MAX_BACKOFF_S = 60.0
RUNNING = LIVE | {ReplicaState.DRAINING}


def canary_autoscaler(endpoint: ScalingPolicy, floor: int) -> Autoscaler:
    """The canary's autoscaler: the endpoint's policy between `floor` and what its
    max_replicas leaves beside one stable replica."""
    floor = max(1, floor)
    policy = replace(
        endpoint,
        min_replicas=floor,
        max_replicas=max(floor, endpoint.max_replicas - 1),
        scale_to_zero=False,
    )
    return Autoscaler(policy)


def max_replicas(state: EndpointState) -> int:
    """The endpoint's ceiling on its replicas, all versions together."""
    return int((state.row.hardware or {}).get("max_replicas", 1))


def running(state: EndpointState, version_id: str | None = None) -> int:
    """Replicas that run (starting, serving, unhealthy or draining), of one version or all."""
    return sum(
        r.state in RUNNING and (version_id is None or r.version_id == version_id)
        for r in state.replicas
    )


def room(state: EndpointState, version_id: str) -> int:
    """How many replicas `version_id` may run beside the other versions' running ones."""
    return max(0, max_replicas(state) - (running(state) - running(state, version_id)))


def stable_cap(state: EndpointState, kept: list[Track]) -> int:
    """The stable version's ceiling beside the kept versions: what they run, or a canary's
    floor if it runs fewer (so the stable drains to make room for it); at least one."""
    held = 0
    for track in kept:
        mine = running(state, track.version_id)
        held += max(mine, track.replicas) if track.role is VersionRole.CANARY else mine
    return max(1, max_replicas(state) - held)


def size(state: EndpointState, track: Track, replicas: ReplicaController) -> list[Replica]:
    """Bring `track`'s live replicas to its target (its own autoscaler's, else the count it was
    given): returns the new ones to start; extra ones start draining."""
    live = [r for r in state.live if r.version_id == track.version_id]
    if any(r.state is ReplicaState.READY for r in live):
        track.failures = 0
    now = time.monotonic()
    target = track.replicas
    scaled = track.role is VersionRole.CANARY  # a previous version keeps its count
    if scaled and track.autoscaler is not None and track.load is not None:
        track.autoscaler.observe(track.load.observe(now, state.route, track.weight, live))
        target = track.autoscaler.decide(now, len(live)).desired
    if track.slo.rollout:  # surges beside the stable version to the endpoint's own count
        target = max(1, state.desired)
    else:
        target = min(target, room(state, track.version_id))
    track.desired = target
    missing = target - len(live)
    if missing < 0:
        for replica in scale_down_order(live, replicas.placement)[:-missing]:
            replica.state = ReplicaState.DRAINING
            if replica.route is not None:
                replicas.routing.mark_unready(replica.route)
                spawn(state, replicas.drain(state, replica))
        return []
    if missing == 0 or now < track.next_start_at:
        return []
    if track.failures:
        backoff = min(_MAX_BACKOFF_S, 2.0 ** min(track.failures, 6))
        track.next_start_at = now + backoff
    fresh = [Replica(repo.new_id("rep"), version_id=track.version_id) for _ in range(missing)]
    state.replicas.extend(fresh)
    return fresh
