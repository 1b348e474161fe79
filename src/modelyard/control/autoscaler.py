"""The autoscaling decision for one endpoint: how many replicas it should have now, and why.

Knative's KPA idea on the spec's `scaling` block: the metric (engine busy fraction, requests in
flight, queued requests or requests/s, summed over replicas) is averaged over a stable window
(60 s) and a panic window (6 s); desired = ceil(average / target per replica). When the panic
window asks for at least twice the current replicas the endpoint enters panic mode for a
stable window: it scales up at once and never down. Scale-down waits `scale_down_delay_s`
(the highest recommendation over that delay wins), and with `scale_to_zero` an endpoint that
saw no request for `scale_to_zero_after_idle_seconds` goes to zero. The clock is injected: the
same code runs in the platform and in the fleet simulator.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

METRICS = ("gpu_utilization", "concurrency", "queue_depth", "requests_per_second")
MIN_IDLE_TO_ZERO_S = 60.0


@dataclass(frozen=True)
class ScalingPolicy:
    metric: str = "concurrency"
    target: float = 8.0  # per replica; gpu_utilization in percent (0-100)
    min_replicas: int = 1
    max_replicas: int = 1
    scale_to_zero: bool = False
    idle_to_zero_s: float = 300.0
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    panic_threshold: float = 2.0
    scale_down_delay_s: float = 30.0

    @classmethod
    def from_deploy(cls, hardware: dict[str, Any], scaling: dict[str, Any]) -> ScalingPolicy:
        """From a deploy request's `hardware` and `scaling` blocks (as stored on the endpoint)."""
        metric = scaling.get("metric", "concurrency")
        if metric not in METRICS:
            raise ValueError(f"scaling.metric must be one of {', '.join(METRICS)}")
        return cls(
            metric=metric,
            target=float(scaling.get("target_value", 70.0 if metric == "gpu_utilization" else 8)),
            min_replicas=int(hardware.get("min_replicas", 1)),
            max_replicas=int(hardware.get("max_replicas", 1)),
            scale_to_zero=bool(scaling.get("scale_to_zero", False)),
            idle_to_zero_s=float(scaling.get("scale_to_zero_after_idle_seconds", 300)),
            stable_window_s=float(scaling.get("stable_window_seconds", 60)),
            panic_window_s=float(scaling.get("panic_window_seconds", 6)),
            panic_threshold=float(scaling.get("panic_threshold", 2.0)),
            scale_down_delay_s=float(scaling.get("scale_down_delay_seconds", 30)),
        )

    def per_replica_target(self) -> float:
        # The busy fraction is observed in 0..1 per replica; the target is given in percent.
        return self.target / 100.0 if self.metric == "gpu_utilization" else self.target


@dataclass(frozen=True, slots=True)
class Observation:
    """What the endpoint looked like at `at`: the metric summed over its replicas, and whether
    any request arrived since the previous observation."""

    at: float
    value: float
    active: bool


@dataclass(frozen=True, slots=True)
class Decision:
    at: float
    current: int
    desired: int
    reason: str
    panic: bool

    def view(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "current": self.current,
            "desired": self.desired,
            "reason": self.reason,
            "panic": self.panic,
        }


@dataclass
class Autoscaler:
    policy: ScalingPolicy
    _samples: deque[Observation] = field(default_factory=deque)
    _sum: float = 0.0  # of the values in `_samples`
    _dropped: int = 0
    _recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    _last_active: float | None = None
    _panic_until: float = -math.inf
    last: Decision | None = None
    # Keep-warm weighed by reload cost: with `idle_per_reload` > 0 and the model's measured
    # reload time known, an idle endpoint goes to zero after idle_per_reload x reload_s (at
    # least 60 s, at most the policy's idle time): a replica that reloads in seconds is not
    # worth minutes of an idle device. Set by the control loop (`scaling.Scaler`).
    idle_per_reload: float = 0.0
    reload_s: float | None = None

    def idle_limit(self) -> float:
        """Seconds without a request after which the endpoint scales to zero."""
        limit = self.policy.idle_to_zero_s
        if self.idle_per_reload > 0 and self.reload_s is not None:
            limit = min(limit, max(MIN_IDLE_TO_ZERO_S, self.idle_per_reload * self.reload_s))
        return limit

    def observe(self, obs: Observation) -> None:
        self._samples.append(obs)
        self._sum += obs.value
        if obs.active or self._last_active is None:
            self._last_active = obs.at  # the first sight of an endpoint counts as activity
        self._forget(obs.at - self.policy.stable_window_s)

    def _forget(self, horizon: float) -> None:
        """Drop the samples older than `horizon`, keeping the running sum of the rest."""
        samples = self._samples
        while samples and samples[0].at < horizon:
            self._sum -= samples.popleft().value
            self._dropped += 1
        if not samples or self._dropped >= 4096:  # re-add now and then: no rounding drift
            self._sum = sum(s.value for s in samples)
            self._dropped = 0

    def mark_active(self, at: float) -> None:
        """A request arrived (also for an endpoint at zero, which has no replica to observe)."""
        self._last_active = at

    def _average(self, now: float, window: float) -> float:
        """Mean of the samples of the last `window` seconds: the stable window from the running
        sum (decisions come every tick, so this is O(1)), shorter windows from the newest end."""
        if window >= self.policy.stable_window_s:
            self._forget(now - window)
            n = len(self._samples)
            if window == self.policy.stable_window_s:
                return self._sum / n if n else 0.0
        total, n = 0.0, 0
        for s in reversed(self._samples):
            if s.at < now - window:
                break
            total += s.value
            n += 1
        return total / n if n else 0.0

    def decide(self, now: float, current: int) -> Decision:
        p = self.policy
        target = p.per_replica_target()
        stable = math.ceil(self._average(now, p.stable_window_s) / target - 1e-9)
        panic_want = math.ceil(self._average(now, p.panic_window_s) / target - 1e-9)
        idle_for = now - self._last_active if self._last_active is not None else 0.0

        if current > 0 and panic_want >= p.panic_threshold * current and panic_want > current:
            self._panic_until = now + p.stable_window_s
        panic = now < self._panic_until
        floor = max(p.min_replicas, 1)
        if panic:
            want = max(panic_want, current)
            reason = f"panic: {p.metric} over {p.panic_window_s:g}s wants {panic_want}"
        else:
            want = stable
            reason = f"{p.metric} over {p.stable_window_s:g}s averages to {want} replica(s)"

        idle_limit = self.idle_limit()
        if p.scale_to_zero and idle_for >= idle_limit and not panic:
            self._recommendations.clear()
            return self._record(now, current, 0, f"idle for {idle_for:.0f}s: scale to zero", False)
        if current == 0 and self._last_active is not None and idle_for < idle_limit:
            want = max(want, 1)
            reason = "a request arrived: scale from zero"

        want = min(max(want, floor), p.max_replicas)
        # Scale down only to the highest recommendation of the last `scale_down_delay_s`.
        self._recommendations.append((now, want))
        while self._recommendations and self._recommendations[0][0] < now - p.scale_down_delay_s:
            self._recommendations.popleft()
        if want < current and not panic:
            held = max(r for _, r in self._recommendations)
            if held > want:
                reason += f"; holding {held} for the scale-down delay"
                want = min(held, current)
        return self._record(now, current, want, reason, panic)

    def _record(self, now: float, current: int, desired: int, reason: str, panic: bool) -> Decision:
        self.last = Decision(now, current, desired, reason, panic)
        return self.last
