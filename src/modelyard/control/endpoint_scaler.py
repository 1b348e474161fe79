"""`Scaler`: each controller tick, per endpoint, record its traffic, wake it if its history
predicts traffic while it is at zero, and let its autoscaler (`autoscaler.py`, fed by
`scaling.py`'s `LoadTracker`) set the replicas it should have; decisions counted for /metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from modelyard.config import PlatformSettings
from modelyard.control.autoscaler import Decision
from modelyard.control.prewarm import TrafficHistory, should_prewarm
from modelyard.control.scaling import READS_REPLICA_LOADS
from modelyard.control.state import EndpointState
from modelyard.core.status import LIVE, EndpointStatus, ReplicaState

log = logging.getLogger(__name__)

# The reconciler's `activate` of one endpoint's state (what `core.routing.Activate`, the
# gateway's verb by endpoint id, ends in).
ActivateState = Callable[[EndpointState], None]
_NO_LOADS: dict[str, dict[str, Any]] = {}  # the other metrics' (never written to)


class Scaler:
    """Each tick, per endpoint: record its traffic, wake it if its history predicts traffic
    while it is at zero, and let its autoscaler set the replicas it should have."""

    def __init__(self, settings: PlatformSettings, history: TrafficHistory) -> None:
        self.settings = settings
        self.history = history
        # (endpoint, up|down, reason) -> changes of desired replicas so far, for /metrics.
        self.decided: dict[tuple[str, str, str], int] = {}

    def autoscale(self, state: EndpointState, activate: ActivateState) -> None:
        # This runs for every endpoint each tick (10,000 in ~100 ms is the budget): no object
        # that outlives the call, no list built to be counted, and what only some metrics or
        # settings read is gathered only for them.
        autoscaler, tracker = state.autoscaler, state.load
        if autoscaler is None or tracker is None:
            return
        if state.status is EndpointStatus.PROVISIONING and not state.serving:
            return  # nothing to judge until it serves (and a cold start is no idleness)
        now = time.monotonic()
        route = state.route
        total = route.requests_total
        if total != state.requests_seen:  # `record` keeps nothing of no requests
            self.history.record(route.endpoint_id, time.time(), total - state.requests_seen)
            state.requests_seen = total
        live = 0
        for r in state.replicas:
            if r.state in LIVE:
                live += 1
        if not live and state.desired == 0:
            self.maybe_prewarm(state, activate)
        loads = (
            {
                r.replica_id: r.load
                for r in state.replicas
                if r.state is ReplicaState.READY and r.load
            }
            if tracker.metric in READS_REPLICA_LOADS
            else _NO_LOADS
        )
        factor = self.settings.scale_to_zero_reload_factor
        if factor > 0:
            # Keep-warm weighed by reload cost: the fastest measured load of this endpoint's
            # replicas (kept while it is at zero, since the autoscaler keeps it).
            reloads = [r.ready_after_s for r in state.replicas if r.ready_after_s is not None]
            if reloads:
                autoscaler.reload_s = min(reloads)
        autoscaler.idle_per_reload = factor
        value, active = tracker.sample(now, route, loads)
        autoscaler.add(now, value, active)
        desired = autoscaler.desired(now, live)
        if desired != live:
            decision = autoscaler.last
            assert decision is not None  # just decided
            state.decisions.append(decision)
            self.count(state.row.id, decision)
            log.info(
                "endpoint %s: %d -> %d replicas (%s)",
                state.row.id, decision.current, decision.desired, decision.reason,
            )  # fmt: skip
        state.desired = desired

    def count(self, endpoint_id: str, decision: Decision) -> None:
        """One more change of `endpoint_id`'s desired replicas, under a reason of few values."""
        direction = "up" if decision.desired > decision.current else "down"
        reason = "panic" if decision.panic else "load"
        for prefix, kind in (("idle", "idle"), ("a request", "request"), ("pre-warm", "prewarm")):
            if decision.reason.startswith(prefix):
                reason = kind
        key = (endpoint_id, direction, reason)
        self.decided[key] = self.decided.get(key, 0) + 1

    def maybe_prewarm(self, state: EndpointState, activate: ActivateState) -> None:
        s = self.settings
        expected = should_prewarm(
            self.history, state.row.id, time.time(), s.prewarm_lead_s, s.prewarm_min_requests
        )
        if expected is None:
            return
        reason = f"pre-warm: {expected:.1f} requests expected within {s.prewarm_lead_s:g}s"
        state.decisions.append(Decision(time.monotonic(), 0, 1, reason, False))
        self.count(state.row.id, state.decisions[-1])
        log.info("endpoint %s: %s", state.row.id, reason)
        activate(state)
