"""`VersionLoad`: one endpoint version's load, observed each tick from its routing entry and
its replicas' reports, as the metric its autoscaler scales on (concurrency, queue depth,
requests per second or busy time)."""

from __future__ import annotations

from dataclasses import dataclass, field

from modelyard.control.autoscaler import Observation
from modelyard.control.state import Replica
from modelyard.core.routing import EndpointRoute
from modelyard.core.status import ReplicaState


@dataclass
class VersionLoad:
    """One version's load, observed each tick (see the module's docstring)."""

    metric: str
    _busy: dict[str, tuple[float, float]] = field(default_factory=dict)  # replica → (at, busy s)
    _requests: int | None = None
    _at: float | None = None

    def observe(
        self, now: float, route: EndpointRoute, weight: int, replicas: list[Replica]
    ) -> Observation:
        share = max(0, min(100, weight)) / 100
        elapsed = now - self._at if self._at is not None else 0.0
        new = route.requests_total - self._requests if self._requests is not None else 0
        self._requests, self._at = route.requests_total, now
        ready = [r for r in replicas if r.state is ReplicaState.READY]
        in_flight = sum(r.route.outstanding for r in ready if r.route is not None)
        queued = route.waiting * share
        active = in_flight > 0 or (share > 0 and (new > 0 or route.waiting > 0))

        if self.metric == "concurrency":
            value = in_flight + queued
        elif self.metric == "queue_depth":
            value = queued + sum(int((r.load or {}).get("waiting", 0)) for r in ready)
        elif self.metric == "requests_per_second":
            value = new * share / elapsed if elapsed > 0 else 0.0
        else:  # gpu_utilization
            value = 0.0
            seen = set()
            for r in ready:
                if r.load is None:
                    continue
                seen.add(r.replica_id)
                busy = float(r.load.get("busy_seconds", 0.0))
                last = self._busy.get(r.replica_id)
                if last is not None and now > last[0]:
                    value += min(1.0, max(0.0, (busy - last[1]) / (now - last[0])))
                self._busy[r.replica_id] = (now, busy)
            for gone in set(self._busy) - seen:
                del self._busy[gone]
        return Observation(at=now, value=float(value), active=active)
