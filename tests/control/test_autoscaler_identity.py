"""The controller's fast autoscaling pass decides exactly as a plain, full evaluation does.

`Autoscaler`, `LoadTracker`, `TrafficHistory` and `Scaler.autoscale` keep running aggregates and
skip work on the controller's tick (10,000 endpoints a tick). The reference here is the plain
evaluation they replaced, kept as the specification: every sample an `Observation` in a deque,
the panic window summed from the newest sample each decision, every recommendation of the
scale-down delay kept and its maximum taken, the reason formatted each time, the history's
weekly buckets updated on every record. Random traffic, policies and clocks drive both side by
side; every decision (at, current, desired, reason, panic), every change recorded, every pre-warm
and the saved history must be equal, and the window averages equal to the last bit.
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelyard.config import PlatformSettings
from modelyard.control import endpoint_scaler
from modelyard.control.autoscaler import Autoscaler, Decision, Observation, ScalingPolicy
from modelyard.control.endpoint_scaler import Scaler
from modelyard.control.prewarm import TrafficHistory, hour_of_week, should_prewarm
from modelyard.control.scaling import LoadTracker
from modelyard.control.state import EndpointState, Replica
from modelyard.core.routing import EndpointRoute, ReplicaRoute
from modelyard.core.status import LIVE, EndpointStatus, ReplicaState
from modelyard.store.tables import Endpoint

# ----- the reference: the plain evaluation ------------------------------------------------------


@dataclass
class RefAutoscaler:
    policy: ScalingPolicy
    samples: deque[Observation] = field(default_factory=deque)
    total: float = 0.0
    dropped: int = 0
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    last_active: float | None = None
    panic_until: float = -math.inf
    last: Decision | None = None
    idle_per_reload: float = 0.0
    reload_s: float | None = None

    def idle_limit(self) -> float:
        limit = self.policy.idle_to_zero_s
        if self.idle_per_reload > 0 and self.reload_s is not None:
            limit = min(limit, max(60.0, self.idle_per_reload * self.reload_s))
        return limit

    def observe(self, obs: Observation) -> None:
        self.samples.append(obs)
        self.total += obs.value
        if obs.active or self.last_active is None:
            self.last_active = obs.at
        self.forget(obs.at - self.policy.stable_window_s)

    def forget(self, horizon: float) -> None:
        while self.samples and self.samples[0].at < horizon:
            self.total -= self.samples.popleft().value
            self.dropped += 1
        if not self.samples or self.dropped >= 4096:
            self.total = sum(s.value for s in self.samples)
            self.dropped = 0

    def average(self, now: float, window: float) -> float:
        if window >= self.policy.stable_window_s:
            self.forget(now - window)
            n = len(self.samples)
            if window == self.policy.stable_window_s:
                return self.total / n if n else 0.0
        total, n = 0.0, 0
        for s in reversed(self.samples):
            if s.at < now - window:
                break
            total += s.value
            n += 1
        return total / n if n else 0.0

    def decide(self, now: float, current: int) -> Decision:
        p = self.policy
        target = p.per_replica_target()
        stable = math.ceil(self.average(now, p.stable_window_s) / target - 1e-9)
        panic_want = math.ceil(self.average(now, p.panic_window_s) / target - 1e-9)
        idle_for = now - self.last_active if self.last_active is not None else 0.0
        if current > 0 and panic_want >= p.panic_threshold * current and panic_want > current:
            self.panic_until = now + p.stable_window_s
        panic = now < self.panic_until
        if panic:
            want = max(panic_want, current)
            reason = f"panic: {p.metric} over {p.panic_window_s:g}s wants {panic_want}"
        else:
            want = stable
            reason = f"{p.metric} over {p.stable_window_s:g}s averages to {want} replica(s)"
        if p.scale_to_zero and idle_for >= self.idle_limit() and not panic:
            self.recommendations.clear()
            self.last = Decision(now, current, 0, f"idle for {idle_for:.0f}s: scale to zero", False)
            return self.last
        if current == 0 and self.last_active is not None and idle_for < self.idle_limit():
            want = max(want, 1)
            reason = "a request arrived: scale from zero"
        want = min(max(want, max(p.min_replicas, 1)), p.max_replicas)
        self.recommendations.append((now, want))
        while self.recommendations and self.recommendations[0][0] < now - p.scale_down_delay_s:
            self.recommendations.popleft()
        if want < current and not panic:
            held = max(r for _, r in self.recommendations)
            if held > want:
                reason += f"; holding {held} for the scale-down delay"
                want = min(held, current)
        self.last = Decision(now, current, want, reason, panic)
        return self.last


@dataclass
class RefTracker:
    metric: str
    busy: dict[str, tuple[float, float]] = field(default_factory=dict)
    requests: int | None = None
    at: float | None = None

    def observe(self, now: float, route: EndpointRoute, loads: dict[str, Any]) -> Observation:
        elapsed = now - self.at if self.at is not None else 0.0
        new = route.requests_total - self.requests if self.requests is not None else 0
        self.requests, self.at = route.requests_total, now
        active = new > 0 or route.outstanding > 0 or route.waiting > 0
        if self.metric == "concurrency":
            value = float(route.outstanding + route.waiting)
        elif self.metric == "queue_depth":
            value = float(route.waiting + sum(int(x.get("waiting", 0)) for x in loads.values()))
        elif self.metric == "requests_per_second":
            value = new / elapsed if elapsed > 0 else 0.0
        else:
            value = 0.0
            for replica_id, load in loads.items():
                busy = float(load.get("busy_seconds", 0.0))
                last = self.busy.get(replica_id)
                if last is not None and now > last[0]:
                    value += min(1.0, max(0.0, (busy - last[1]) / (now - last[0])))
                self.busy[replica_id] = (now, busy)
            for gone in set(self.busy) - set(loads):
                del self.busy[gone]
        return Observation(at=now, value=value, active=active)


class RefHistory(TrafficHistory):
    """Every record straight into the weekly buckets."""

    def record(self, endpoint_id: str, at: float, requests: int = 1) -> None:
        if requests <= 0:
            return
        week, how = hour_of_week(at)
        self._first_week.setdefault(endpoint_id, week)
        per_week = self._counts[endpoint_id][how]
        if week in per_week:
            per_week[week] += requests
            return
        per_week[week] = requests
        for old in [w for w in per_week if w <= week - self.weeks]:
            del per_week[old]


def ref_count(
    decided: defaultdict[tuple[str, str, str], int], endpoint_id: str, d: Decision
) -> None:
    direction = "up" if d.desired > d.current else "down"
    reason = "panic" if d.panic else "load"
    for prefix, kind in (("idle", "idle"), ("a request", "request"), ("pre-warm", "prewarm")):
        if d.reason.startswith(prefix):
            reason = kind
    decided[(endpoint_id, direction, reason)] += 1


@dataclass
class RefEndpoint:
    """The reference's own view of an endpoint: what `Scaler.autoscale` writes."""

    autoscaler: RefAutoscaler
    tracker: RefTracker
    desired: int = 1
    requests_seen: int = 0
    decisions: list[Decision] = field(default_factory=list)


def reference_autoscale(
    s: PlatformSettings,
    history: TrafficHistory,
    decided: defaultdict[tuple[str, str, str], int],
    state: EndpointState,
    ref: RefEndpoint,
    now: float,
    wall: float,
) -> bool:
    """`Scaler.autoscale` as a full evaluation, on the state's shared route and replicas;
    returns whether it pre-warmed."""
    if state.status is EndpointStatus.PROVISIONING and not state.serving:
        return False
    route = state.route
    history.record(route.endpoint_id, wall, route.requests_total - ref.requests_seen)
    ref.requests_seen = route.requests_total
    live = len([r for r in state.replicas if r.state in LIVE])
    woken = False
    if not live and ref.desired == 0:
        expected = should_prewarm(
            history, state.row.id, wall, s.prewarm_lead_s, s.prewarm_min_requests
        )
        if expected is not None:
            reason = f"pre-warm: {expected:.1f} requests expected within {s.prewarm_lead_s:g}s"
            ref.decisions.append(Decision(now, 0, 1, reason, False))
            ref_count(decided, state.row.id, ref.decisions[-1])
            woken = True
    loads = (
        {r.replica_id: r.load for r in state.replicas if r.state is ReplicaState.READY and r.load}
        if ref.tracker.metric in ("queue_depth", "gpu_utilization")
        else {}
    )
    if s.scale_to_zero_reload_factor > 0:
        reloads = [r.ready_after_s for r in state.replicas if r.ready_after_s is not None]
        if reloads:
            ref.autoscaler.reload_s = min(reloads)
    ref.autoscaler.idle_per_reload = s.scale_to_zero_reload_factor
    ref.autoscaler.observe(ref.tracker.observe(now, route, loads))
    decision = ref.autoscaler.decide(now, live)
    if decision.desired != decision.current:
        ref.decisions.append(decision)
        ref_count(decided, state.row.id, decision)
    ref.desired = decision.desired
    return woken


# ----- the autoscaler alone: any values, any calls ---------------------------------------------

value_st = st.one_of(
    st.integers(0, 40).map(float),
    st.floats(0.0, 50.0, allow_nan=False),
    st.sampled_from([0.1, 0.2, 0.3, 1 / 3, 7.999999999, 8.000000001, 1e-12]),
)
policy_st = st.builds(
    ScalingPolicy,
    metric=st.sampled_from(
        ["concurrency", "queue_depth", "requests_per_second", "gpu_utilization"]
    ),
    target=st.sampled_from([0.3, 1.0, 2.5, 8.0, 70.0]),
    min_replicas=st.integers(0, 3),
    max_replicas=st.integers(1, 12),
    scale_to_zero=st.booleans(),
    idle_to_zero_s=st.sampled_from([10.0, 30.0, 300.0]),
    stable_window_s=st.sampled_from([6.0, 20.0, 60.0]),
    panic_window_s=st.sampled_from([2.0, 6.0, 20.0, 90.0]),
    panic_threshold=st.sampled_from([1.0, 2.0, 3.0]),
    scale_down_delay_s=st.sampled_from([0.0, 5.0, 30.0]),
)
# (seconds the clock moves, what happens): observations, decisions, a request at zero.
step_st = st.tuples(
    st.sampled_from([0.0, 0.5, 1.0, 2.0, 2.0, 7.0, 45.0]),
    st.one_of(
        st.tuples(st.just("observe"), value_st, st.booleans()),
        st.tuples(st.just("decide"), st.integers(0, 14)),
        st.tuples(st.just("active")),
    ),
)


@settings(max_examples=300, deadline=None)
@given(policy=policy_st, steps=st.lists(step_st, max_size=150), reload=st.sampled_from([0, 1, 9]))
def test_any_sequence_decides_as_the_full_evaluation(
    policy: ScalingPolicy, steps: list[tuple[float, tuple[Any, ...]]], reload: int
) -> None:
    fast, ref = Autoscaler(policy), RefAutoscaler(policy)
    fast.idle_per_reload = ref.idle_per_reload = float(reload)
    fast.reload_s = ref.reload_s = 5.0
    now = 1000.0
    for dt, (what, *args) in steps:
        now += dt
        if what == "observe":
            fast.observe(Observation(now, args[0], args[1]))
            ref.observe(Observation(now, args[0], args[1]))
        elif what == "decide":
            assert fast.decide(now, args[0]) == ref.decide(now, args[0])
            assert fast.last == ref.last
            for window in (policy.stable_window_s, policy.panic_window_s):
                assert fast._average(now, window) == ref.average(now, window)
        else:
            fast.mark_active(now)
            ref.last_active = now


def test_a_long_run_with_fractional_values_stays_bit_identical() -> None:
    """Past the running sum's periodic re-add (4,096 dropped samples), many cut-offs of the
    sample list and windows left empty, with values whose sums round differently in any other
    order."""
    rng = random.Random(7)
    policy = ScalingPolicy(metric="requests_per_second", target=0.7, max_replicas=20,
                           stable_window_s=60, panic_window_s=6, scale_down_delay_s=30)  # fmt: skip
    fast, ref = Autoscaler(policy), RefAutoscaler(policy)
    now, current = 0.0, 1
    for i in range(12_000):
        now += rng.choice([1.0, 2.0, 0.25])
        if i % 5000 == 4999:  # a decision long after the last sample: every sample goes
            now += 100.0
            assert fast.decide(now, current) == ref.decide(now, current)
            assert fast._sum == ref.total == 0
        value = rng.random() * (12 if (i // 500) % 2 else 2)
        fast.add(now, value, value > 0.5)
        ref.observe(Observation(now, value, value > 0.5))
        desired = fast.desired(now, current)
        assert fast.last == ref.decide(now, current)
        assert fast._sum == ref.total
        current = desired
    assert fast._dropped == ref.dropped


# ----- the controller's pass: endpoints, traffic, replicas, history -----------------------------


def _endpoint(i: int, policy: ScalingPolicy, replicas: int) -> EndpointState:
    row = Endpoint(id=f"ep-{i}", tenant_id="t", model_name=f"m{i}", public=False)
    route = EndpointRoute(row.id, "t", row.model_name, False, None, 4096)
    state = EndpointState(row=row, route=route, status=EndpointStatus.READY, desired=replicas)
    for _ in range(replicas):
        _start(state, ready=True)
    state.autoscaler, state.load = Autoscaler(policy), LoadTracker(policy.metric)
    return state


def _start(state: EndpointState, ready: bool) -> None:
    rid = f"{state.row.id}-r{len(state.replicas)}"
    rr = ReplicaRoute(replica_id=rid, url="http://x")
    replica = Replica(replica_id=rid, route=rr, state=ReplicaState.STARTING, load={})
    state.replicas.append(replica)
    if ready:
        _ready(state, replica)


def _ready(state: EndpointState, replica: Replica) -> None:
    replica.state, replica.ready_after_s = ReplicaState.READY, 3.0 + len(state.replicas)
    assert replica.route is not None
    state.route.replicas.append(replica.route)


def _traffic(rng: random.Random, state: EndpointState, busy: bool, dt: float) -> None:
    """The gateway's counters and the replicas' /health between two ticks."""
    route = state.route
    route.requests_total += rng.choice([0, 1, 3, 17]) if busy else 0
    route.remote_waiting = rng.choice([0, 0, 2, 9]) if busy else 0
    for r in state.replicas:
        if r.state is ReplicaState.READY and r.route is not None and r.load is not None:
            r.route.outstanding = rng.choice([rng.randint(0, 20)] * 30 + [700]) if busy else 0
            r.load["waiting"] = rng.choice([0, 1, 5]) if busy else 0
            r.load["busy_seconds"] = r.load.get("busy_seconds", 0.0) + rng.random() * dt * busy


def _converge(rng: random.Random, state: EndpointState) -> None:
    """Replicas follow the desired count, some a tick late (starting)."""
    live = [r for r in state.replicas if r.state in LIVE]
    for r in live:
        if r.state is ReplicaState.STARTING and rng.random() < 0.6:
            _ready(state, r)
    if len(live) < state.desired:
        _start(state, ready=rng.random() < 0.3)
    elif len(live) > state.desired:
        gone = live[-1]
        gone.state = ReplicaState.STOPPED
        if gone.route in state.route.replicas:
            state.route.replicas.remove(gone.route)


@pytest.mark.parametrize("seed", range(6))
def test_the_pass_decides_as_the_full_evaluation(
    seed: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rng = random.Random(seed)
    s = PlatformSettings(scale_to_zero_reload_factor=rng.choice([0.0, 10.0]))
    history, ref_history = TrafficHistory(), RefHistory()
    scaler = Scaler(s, history)
    ref_decided: dict[tuple[str, str, str], int] = defaultdict(int)
    clock = [5000.0]
    epoch = 1_790_000_000.0 - clock[0]
    monkeypatch.setattr(
        endpoint_scaler,
        "time",
        SimpleNamespace(monotonic=lambda: clock[0], time=lambda: epoch + clock[0]),
    )
    states, refs = [], []
    for i in range(12):
        metric = ["concurrency", "queue_depth", "requests_per_second", "gpu_utilization"][i % 4]
        policy = ScalingPolicy(
            metric=metric,
            target=rng.choice([2.0, 8.0, 50.0 if metric == "gpu_utilization" else 4.0]),
            min_replicas=rng.choice([0, 1, 2]),
            max_replicas=rng.choice([1, 4, 8]),
            scale_to_zero=rng.random() < 0.6,
            idle_to_zero_s=rng.choice([60.0, 120.0]),
            scale_down_delay_s=rng.choice([0.0, 30.0]),
        )
        state = _endpoint(i, policy, rng.choice([0, 1, 2]))
        state.desired = len(state.replicas)
        states.append(state)
        refs.append(RefEndpoint(RefAutoscaler(policy), RefTracker(metric), desired=state.desired))
    woken: list[str] = []
    busy = [True] * len(states)
    for tick in range(1500):
        dt = rng.choice([2.0] * 12 + [0.0, 1.0, 30.0, 1800.0, 6 * 3600.0])  # and days, weeks
        clock[0] += dt
        for i, (state, ref) in enumerate(zip(states, refs, strict=True)):
            if rng.random() < 0.05:
                busy[i] = not busy[i]  # bursts and long quiet spells (scale to zero)
            _traffic(rng, state, busy[i], dt)
            if busy[i] and not any(r.state in LIVE for r in state.replicas) and tick % 7 == 0:
                assert state.autoscaler is not None
                state.autoscaler.mark_active(clock[0])  # a request at zero (the gateway)
                ref.autoscaler.last_active = clock[0]
            before = len(woken)
            scaler.autoscale(state, lambda st: woken.append(st.row.id))
            if reference_autoscale(
                s, ref_history, ref_decided, state, ref, clock[0], epoch + clock[0]
            ):
                assert woken[before:] == [state.row.id]
            else:
                assert len(woken) == before
            assert state.autoscaler is not None
            assert state.autoscaler.last == ref.autoscaler.last, (seed, tick, i)
            assert state.desired == ref.desired
            assert list(state.decisions) == ref.decisions[-20:]
            if len(woken) > before:  # both activate it: it wakes
                state.desired = ref.desired = 1
            _converge(rng, state)
    assert scaler.decided == dict(ref_decided)
    assert len(scaler.decided) > 10  # it scaled up, down, to zero and back
    history.save(tmp_path / "fast.json")
    ref_history.save(tmp_path / "ref.json")
    assert json.loads((tmp_path / "fast.json").read_text()) == json.loads(
        (tmp_path / "ref.json").read_text()
    )


def test_the_history_reads_an_hour_not_yet_added() -> None:
    """Requests of an hour stay pending until another hour is recorded: a read, a save or a
    load in between sees them (here, a week later, without any record since)."""
    fast, ref = TrafficHistory(weeks=2), RefHistory(weeks=2)
    monday_9am = 1_793_610_000.0  # 2026-11-02 09:00 UTC, a Monday
    for history in (fast, ref):
        history.record("ep", monday_9am + 60, 5)
        history.record("ep", monday_9am + 120, 2)
    week_later = monday_9am + 7 * 86400 + 30
    assert fast.expected("ep", week_later) == ref.expected("ep", week_later) == 7
