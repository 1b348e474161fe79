"""What one fleet variant counts, and the figures an SRE reads off it.

Definitions (the tests in tests/test_fleet_sim.py hold these to the token):

- token-slot utilization = tokens processed (prompt + generated, of requests served) / token
  capacity, where a provisioned device's capacity is the tokens/s its replicas would process
  with every slot in use (`Service.capacity`, the mean over the replicas time-sharing it; a
  provisioned device that is empty until its release keeps its last replicas' figure).
- device-hours: devices provisioned (holding a replica, or emptied less than the release delay
  ago) x time; node-hours: nodes with at least one provisioned device x time (8 devices each).
- engine-busy (the old figure, kept for comparison): each ready replica counts the device memory
  it holds while it has a request in flight (in the fluid model: min(1, requests in flight)),
  over provisioned device memory. It counts one request in C slots as fully busy.
- TTFT: queueing wait + (for a request that found no ready replica: a cold request) the time
  until a replica is ready + prefill + half a decode step, each stretched by the device's
  slowdown. Warm requests are sampled (a fixed number per tick, weighted by the requests they
  stand for); cold requests are all counted.
- sessions: a request starts a session when its endpoint saw none for `SESSION_GAP_S`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

SESSION_GAP_S = 900.0
DELAYS = (0.0, 600.0, 3600.0)  # release delays accounted in every run (sensitivity)
PCTS = (50.0, 99.0, 99.9)


def weighted_percentiles(values: np.ndarray, weights: np.ndarray, pcts: tuple) -> list[float]:
    if len(values) == 0 or weights.sum() <= 0:
        return [float("nan")] * len(pcts)
    order = np.argsort(values)
    v, w = values[order], weights[order]
    cum = np.cumsum(w) / w.sum()
    return [float(v[min(len(v) - 1, np.searchsorted(cum, p / 100.0))]) for p in pcts]


@dataclass
class Counters:
    requests: float = 0.0
    cold_requests: float = 0.0
    failed_requests: float = 0.0  # no replica could be placed
    rejected_requests: float = 0.0  # the admission queue was full (429)
    # Per endpoint: device-seconds held (shared devices split by replicas), capacity, tokens.
    ep_device_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ep_capacity: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ep_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0))
    sessions: float = 0.0
    cold_sessions: float = 0.0
    tokens: float = 0.0
    release_delay_s: float = 600.0
    # release delay -> [device-s, node-s, capacity token-s, peak devices, peak nodes]
    by_delay: dict[float, list[float]] = field(default_factory=dict)
    engine_busy_device_s: float = 0.0
    replica_starts: int = 0
    cache_hits: int = 0
    unschedulable: int = 0
    decisions: int = 0
    ttft: list[np.ndarray] = field(default_factory=list)
    wait: list[np.ndarray] = field(default_factory=list)
    weight: list[np.ndarray] = field(default_factory=list)
    cold: list[np.ndarray] = field(default_factory=list)

    @classmethod
    def for_delays(cls, primary: float, endpoints: int) -> Counters:
        z = np.zeros(endpoints)
        return cls(
            release_delay_s=primary,
            by_delay={d: [0.0] * 5 for d in {primary, *DELAYS}},
            ep_device_s=z.copy(),
            ep_capacity=z.copy(),
            ep_tokens=z.copy(),
        )

    def by_group(self, groups: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
        """Share of the occupied device-seconds and token-slot utilization per endpoint group."""
        total = max(float(self.ep_device_s.sum()), 1e-9)
        return {
            name: {
                "device_share_pct": 100 * float(self.ep_device_s[idx].sum()) / total,
                "token_slot_utilization_pct": 100
                * float(self.ep_tokens[idx].sum())
                / max(float(self.ep_capacity[idx].sum()), 1e-9),
            }
            for name, idx in groups.items()
        }

    def provisioning(self, delay: float, seconds: float) -> dict[str, float]:
        device_s, node_s, capacity, peak_devices, peak_nodes = self.by_delay[delay]
        return {
            "token_slot_utilization_pct": 100 * self.tokens / max(capacity, 1e-9),
            "device_hours": device_s / 3600,
            "node_hours": node_s / 3600,
            "mean_devices": device_s / seconds,
            "peak_devices": peak_devices,
            "peak_nodes": peak_nodes,
        }

    def sample(self, ttft: np.ndarray, wait: np.ndarray, weight: np.ndarray, cold: bool) -> None:
        if len(ttft):
            self.ttft.append(np.asarray(ttft, dtype=np.float32))
            self.wait.append(np.asarray(wait, dtype=np.float32))
            self.weight.append(np.asarray(weight, dtype=np.float32))
            self.cold.append(np.full(len(ttft), cold))

    def summary(self, seconds: float) -> dict[str, Any]:
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0)  # noqa: E731
        ttft, wait, wt = cat(self.ttft), cat(self.wait), cat(self.weight)
        cold = cat(self.cold).astype(bool)
        main = self.provisioning(self.release_delay_s, seconds)
        device_s = self.by_delay[self.release_delay_s][0]
        out: dict[str, Any] = main | {
            "engine_busy_pct": 100 * self.engine_busy_device_s / max(device_s, 1e-9),
            "release_delay_s": self.release_delay_s,
            "by_release_delay": {
                f"{d:g}": self.provisioning(d, seconds) for d in sorted(self.by_delay)
            },
            "requests": self.requests,
            "tokens": self.tokens,
            "cold_request_pct": 100 * self.cold_requests / max(self.requests, 1),
            "cold_session_pct": 100 * self.cold_sessions / max(self.sessions, 1),
            "sessions": self.sessions,
            "failed_requests": self.failed_requests,
            "rejected_pct": 100 * self.rejected_requests / max(self.requests, 1),
            "replica_starts": self.replica_starts,
            "cache_hits": self.cache_hits,
            "unschedulable": self.unschedulable,
            "decisions": self.decisions,
        }
        for name, sel in (("warm", ~cold), ("cold", cold), ("all", np.ones_like(cold))):
            for p, v in zip(PCTS, weighted_percentiles(ttft[sel], wt[sel], PCTS), strict=True):
                out[f"ttft_{name}_p{p:g}_s"] = v
        for p, v in zip(PCTS, weighted_percentiles(wait, wt, PCTS), strict=True):
            out[f"queue_wait_p{p:g}_s"] = v
        return out
