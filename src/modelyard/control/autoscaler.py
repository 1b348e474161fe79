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

import enum
import math
from dataclasses import dataclass, field
from typing import Any

METRICS = ("gpu_utilization", "concurrency", "queue_depth", "requests_per_second")
MIN_IDLE_TO_ZERO_S = 60.0


@dataclass(frozen=True, slots=True)
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


class Reason(enum.Enum):
    """Why a decision wants its replica count (the first words of `Decision.reason`)."""

    LOAD = "load"
    PANIC = "panic"
    IDLE = "idle"
    FROM_ZERO = "from_zero"


@dataclass(slots=True)
class Autoscaler:
    """The windows and state of one endpoint's decisions.

    `decide` runs for every endpoint each controller tick (10,000 endpoints: ~100 ms of CPU is
    the budget), so the per-tick path (`add`, `desired`) allocates no object that outlives the
    call: samples are floats in a flat list (no object per sample for the cycle collector to
    walk), the last decision is kept as fields and its `Decision` and reason text are built
    only when read, and the scale-down delay keeps only the recommendations that can still be
    the highest. The arithmetic is the one of a plain evaluation, in the same order, so the
    decisions are the same to the last bit (tests/control/test_autoscaler_identity.py). The clock
    must not go backwards (a monotonic clock, or the simulator's ticks).
    """

    policy: ScalingPolicy
    # The samples, oldest first, from `_head` on: at, value, at, value, ... One flat list, not
    # a deque of objects: the tick reads both ends of it, and one array of pointers is fewer
    # cache lines than per-sample objects (the pass's cost is mostly memory, not bytecode).
    _samples: list[float] = field(default_factory=list)
    _head: int = 0  # where the oldest sample starts; the dropped ones before are cut off in batches
    _sum: float = 0.0  # of the samples' values
    _dropped: int = 0
    # The scale-down delay's recommendations that can still be its highest, as at, want, at,
    # want, ...: wants strictly decreasing (an older one no higher than a newer one never
    # wins again), so it holds a few entries at most.
    _recs: list[float] = field(default_factory=list)
    _last_active: float | None = None
    _panic_until: float = -math.inf
    # The last decision, as fields (`last` builds the `Decision`).
    _at: float | None = None
    _current: int = 0
    _desired: int = 0
    _panic: bool = False
    _reason: Reason = Reason.LOAD
    _reason_n: int | float = 0  # the replicas the load asks for (int), or the idle seconds
    _held: int = 0  # > 0: held for the scale-down delay
    # Keep-warm weighed by reload cost: with `idle_per_reload` > 0 and the model's measured
    # reload time known, an idle endpoint goes to zero after idle_per_reload x reload_s (at
    # least 60 s, at most the policy's idle time): a replica that reloads in seconds is not
    # worth minutes of an idle device. Set by the control loop (`scaling.Scaler`).
    idle_per_reload: float = 0.0
    reload_s: float | None = None

    @property
    def last(self) -> Decision | None:
        if self._at is None:
            return None
        return Decision(self._at, self._current, self._desired, self.reason(), self._panic)

    def reason(self) -> str:
        """The last decision's reason, in words."""
        p, kind, n = self.policy, self._reason, self._reason_n
        if kind is Reason.IDLE:
            return f"idle for {n:.0f}s: scale to zero"
        if kind is Reason.FROM_ZERO:
            text = "a request arrived: scale from zero"
        elif kind is Reason.PANIC:
            text = f"panic: {p.metric} over {p.panic_window_s:g}s wants {n}"
        else:
            text = f"{p.metric} over {p.stable_window_s:g}s averages to {n} replica(s)"
        if self._held:
            text += f"; holding {self._held} for the scale-down delay"
        return text

    def idle_limit(self) -> float:
        """Seconds without a request after which the endpoint scales to zero."""
        limit = self.policy.idle_to_zero_s
        if self.idle_per_reload > 0 and self.reload_s is not None:
            limit = min(limit, max(MIN_IDLE_TO_ZERO_S, self.idle_per_reload * self.reload_s))
        return limit

    def observe(self, obs: Observation) -> None:
        self.add(obs.at, obs.value, obs.active)

    def add(self, at: float, value: float, active: bool) -> None:
        """One observation: the metric's `value` at `at`, and whether a request arrived."""
        samples = self._samples
        samples.append(at)
        samples.append(value)
        self._sum += value
        if active or self._last_active is None:
            self._last_active = at  # the first sight of an endpoint counts as activity
        horizon = at - self.policy.stable_window_s
        if samples[self._head] < horizon:  # else `_forget` has nothing to do (not empty)
            self._forget(horizon)

    def _forget(self, horizon: float) -> None:
        """Drop the samples older than `horizon`, keeping the running sum of the rest. Leaves
        `_dropped` under 4096, so a call that drops nothing from samples changes nothing."""
        samples, head = self._samples, self._head
        end = len(samples)
        if head < end and samples[head] < horizon:
            while head < end and samples[head] < horizon:
                self._sum -= samples[head + 1]
                self._dropped += 1
                head += 2
            if head >= 64 and 2 * head >= end:  # cut the dropped ones off, amortized O(1)
                del samples[:head]
                head, end = 0, end - head
            self._head = head
        if head == end or self._dropped >= 4096:  # re-add now and then: no rounding drift
            self._sum = sum(samples[head + 1 :: 2])
            self._dropped = 0

    def mark_active(self, at: float) -> None:
        """A request arrived (also for an endpoint at zero, which has no replica to observe)."""
        self._last_active = at

    def _average(self, now: float, window: float) -> float:
        """Mean of the samples of the last `window` seconds: the stable window from the running
        sum (decisions come every tick, so this is O(1)), shorter windows from the newest end."""
        if window >= self.policy.stable_window_s:
            samples, horizon = self._samples, now - window
            if self._head == len(samples) or samples[self._head] < horizon:
                self._forget(horizon)
            n = (len(samples) - self._head) // 2
            if window == self.policy.stable_window_s:
                return self._sum / n if n else 0.0
        samples, head = self._samples, self._head
        horizon = now - window
        total, n, i = 0.0, 0, len(samples) - 2
        while i >= head:  # newest first, as the sum has always been taken
            if samples[i] < horizon:
                break
            total += samples[i + 1]
            n += 1
            i -= 2
        return total / n if n else 0.0

    def decide(self, now: float, current: int) -> Decision:
        self.desired(now, current)
        decision = self.last
        assert decision is not None  # just decided
        return decision

    def desired(self, now: float, current: int) -> int:
        """`decide`'s replica count, without building the `Decision` (`last` has it)."""
        p = self.policy
        target = p.per_replica_target()
        stable = math.ceil(self._average(now, p.stable_window_s) / target - 1e-9)
        panic_want = math.ceil(self._average(now, p.panic_window_s) / target - 1e-9)
        last_active = self._last_active
        idle_for = now - last_active if last_active is not None else 0.0

        if current > 0 and panic_want >= p.panic_threshold * current and panic_want > current:
            self._panic_until = now + p.stable_window_s
        panic = now < self._panic_until
        if panic:
            want, reason, reason_n = max(panic_want, current), Reason.PANIC, panic_want
        else:
            want, reason, reason_n = stable, Reason.LOAD, stable

        if p.scale_to_zero or current == 0:  # the only readers of the idle limit
            idle_limit = self.idle_limit()
            if p.scale_to_zero and idle_for >= idle_limit and not panic:
                self._recs.clear()
                return self._record(now, current, 0, False, Reason.IDLE, idle_for, 0)
            if current == 0 and last_active is not None and idle_for < idle_limit:
                want, reason = max(want, 1), Reason.FROM_ZERO

        want = min(max(want, p.min_replicas, 1), p.max_replicas)
        # Scale down only to the highest recommendation of the last `scale_down_delay_s`.
        recs = self._recs
        if recs and recs[-1] == want:
            recs[-2] = now  # the same as dropping it and adding this one
        else:
            while recs and recs[-1] <= want:
                del recs[-2:]
            recs.append(now)
            recs.append(want)
        horizon = now - p.scale_down_delay_s
        while recs and recs[0] < horizon:
            del recs[:2]
        held = 0
        if want < current and not panic:
            highest = int(recs[1])
            if highest > want:
                held, want = highest, min(highest, current)
        return self._record(now, current, want, panic, reason, reason_n, held)

    def _record(
        self,
        now: float,
        current: int,
        desired: int,
        panic: bool,
        reason: Reason,
        reason_n: int | float,
        held: int,
    ) -> int:
        self._at, self._current, self._desired, self._panic = now, current, desired, panic
        self._reason, self._reason_n, self._held = reason, reason_n, held
        return desired
