"""What an endpoint's replicas and the gateway report, turned into the autoscaler's input.

Per tick: the gateway's counters of the endpoint (requests in flight, requests queued for
admission, requests so far) and each replica's `/health` (engine running/waiting sequences, busy
seconds so far) become one `Observation` of the policy's metric, summed over replicas:

- `concurrency`: requests in flight plus queued at the gateway;
- `queue_depth`: queued at the gateway plus waiting in the engines;
- `gpu_utilization`: the engines' busy fraction since the last tick (0..1 per replica; the CPU
  stand-in for GPU utilization);
- `requests_per_second`: new requests since the last tick, per second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelyard.control.autoscaler import Observation
from modelyard.core.routing import EndpointRoute

# The metrics whose observation reads the replicas' /health reports.
READS_REPLICA_LOADS = ("queue_depth", "gpu_utilization")


@dataclass(slots=True)
class LoadTracker:
    metric: str
    _busy: dict[str, tuple[float, float]] = field(default_factory=dict)  # replica → (at, busy s)
    _requests: int | None = None
    _at: float | None = None

    def observe(
        self, now: float, route: EndpointRoute, loads: dict[str, dict[str, Any]]
    ) -> Observation:
        value, active = self.sample(now, route, loads)
        return Observation(at=now, value=value, active=active)

    def sample(
        self, now: float, route: EndpointRoute, loads: dict[str, dict[str, Any]]
    ) -> tuple[float, bool]:
        """`observe`'s value and activity, without the `Observation` (the controller's tick)."""
        elapsed = now - self._at if self._at is not None else 0.0
        total = route.requests_total
        new_requests = total - (self._requests or 0) if self._requests is not None else 0
        self._requests, self._at = total, now
        outstanding, waiting = route.outstanding, route.waiting  # each read once: sums
        active = new_requests > 0 or outstanding > 0 or waiting > 0

        metric = self.metric
        if metric == "concurrency":
            value = float(outstanding + waiting)
        elif metric == "queue_depth":
            value = float(waiting + sum(int(x.get("waiting", 0)) for x in loads.values()))
        elif metric == "requests_per_second":
            value = new_requests / elapsed if elapsed > 0 else 0.0
        else:  # gpu_utilization
            value = 0.0
            for replica_id, load in loads.items():
                busy = float(load.get("busy_seconds", 0.0))
                last = self._busy.get(replica_id)
                if last is not None and now > last[0]:
                    value += min(1.0, max(0.0, (busy - last[1]) / (now - last[0])))
                self._busy[replica_id] = (now, busy)
            for gone in set(self._busy) - set(loads):
                del self._busy[gone]
        return value, active
