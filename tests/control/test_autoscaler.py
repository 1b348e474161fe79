"""The autoscaling decision with an injected clock: stable and panic windows, scale-down delay,
bounds, scale to zero and back."""

from __future__ import annotations

from modelyard.control.autoscaler import Autoscaler, Observation, ScalingPolicy


def feed(a: Autoscaler, start: float, seconds: int, value: float, active: bool = True) -> float:
    t = start
    for _ in range(seconds):
        a.observe(Observation(t, value, active))
        t += 1.0
    return t


def test_desired_follows_the_stable_average() -> None:
    a = Autoscaler(ScalingPolicy(metric="concurrency", target=4, min_replicas=1, max_replicas=10))
    t = feed(a, 0.0, 60, value=10.0)  # 10 in flight, 4 per replica
    d = a.decide(t, current=3)
    assert d.desired == 3 and not d.panic and "concurrency" in d.reason


def test_a_burst_triggers_panic_and_immediate_scale_up() -> None:
    a = Autoscaler(ScalingPolicy(metric="queue_depth", target=2, max_replicas=20))
    t = feed(a, 0.0, 60, value=2.0)
    assert a.decide(t, current=1).desired == 1
    t = feed(a, t, 6, value=20.0)  # the panic window sees 10 replicas' worth
    d = a.decide(t, current=1)
    assert d.panic and d.desired == 10
    # In panic it never scales down, even when the burst is over.
    t = feed(a, t, 10, value=0.0)
    assert a.decide(t, current=10).desired == 10


def test_gpu_utilization_target_is_a_percentage_of_busy_fraction() -> None:
    a = Autoscaler(ScalingPolicy(metric="gpu_utilization", target=70, max_replicas=8))
    t = feed(a, 0.0, 60, value=2.8)  # 4 replicas each 70 % busy
    assert a.decide(t, current=4).desired == 4


def test_scale_down_waits_for_the_delay_and_stays_within_bounds() -> None:
    policy = ScalingPolicy(target=1, min_replicas=2, max_replicas=5, scale_down_delay_s=30)
    a = Autoscaler(policy)
    t, current = 0.0, 5
    for _ in range(60):
        t = feed(a, t, 1, value=9.0)
        assert a.decide(t, current).desired == 5  # clamped to max
    decisions = []
    for _ in range(150):  # the load is gone; the controller runs every second
        t = feed(a, t, 1, value=0.5)
        d = a.decide(t, current)
        decisions.append(d)
        current = d.desired
    held = [d for d in decisions if "holding" in d.reason]
    assert held  # recommendations below the current count waited for the delay
    first_drop = next(i for i, d in enumerate(decisions) if d.desired < 5)
    assert first_drop >= 60  # ~35 s for the stable average to fall, then the 30 s delay
    assert decisions[-1].desired == 2  # min_replicas


def test_scale_to_zero_after_idle_and_back_on_a_request() -> None:
    policy = ScalingPolicy(target=4, min_replicas=1, max_replicas=3, scale_to_zero=True,
                           idle_to_zero_s=120)  # fmt: skip
    a = Autoscaler(policy)
    t = feed(a, 0.0, 30, value=1.0)
    t = feed(a, t, 118, value=0.0, active=False)
    assert a.decide(t, current=1).desired == 1
    t = feed(a, t, 2, value=0.0, active=False)
    d = a.decide(t, current=1)
    assert d.desired == 0 and "scale to zero" in d.reason
    a.mark_active(t + 5)
    back = a.decide(t + 5, current=0)
    assert back.desired == 1 and "from zero" in back.reason


def test_policy_from_the_deploy_body() -> None:
    p = ScalingPolicy.from_deploy(
        {"min_replicas": 0, "max_replicas": 8},
        {"metric": "gpu_utilization", "target_value": 70, "scale_to_zero": True,
         "scale_to_zero_after_idle_seconds": 300},
    )  # fmt: skip
    assert (p.metric, p.target, p.min_replicas, p.max_replicas) == ("gpu_utilization", 70, 0, 8)
    assert p.scale_to_zero and p.idle_to_zero_s == 300


def test_keep_warm_weighed_by_reload_time() -> None:
    """With idle_per_reload, a model that reloads fast goes to zero sooner (60 s at least, the
    policy's idle time at most); without a measured reload time nothing changes."""
    policy = ScalingPolicy(metric="concurrency", target=1, max_replicas=3, scale_to_zero=True)
    scaler = Autoscaler(policy)
    scaler.observe(Observation(0.0, 1.0, True))
    scaler.idle_per_reload = 10.0
    assert scaler.idle_limit() == 300.0  # no reload time measured yet
    scaler.reload_s = 8.0
    assert scaler.idle_limit() == 80.0
    for t in range(2, 80, 2):
        scaler.observe(Observation(float(t), 0.0, False))
        assert scaler.decide(float(t), 1).desired == 1
    scaler.observe(Observation(80.0, 0.0, False))
    assert scaler.decide(80.0, 1).desired == 0
    scaler.reload_s = 2.0
    assert scaler.idle_limit() == 60.0
    scaler.reload_s = 100.0
    assert scaler.idle_limit() == 300.0
