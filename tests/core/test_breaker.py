"""Circuit breaker: opens above 10 % errors, pauses, lets one trial through, closes on success."""

from __future__ import annotations

from modelyard.core.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


def test_opens_above_the_error_rate_then_half_opens_and_closes() -> None:
    b = CircuitBreaker(window_s=30, min_requests=10, error_rate=0.10, open_s=10)
    for i in range(9):
        b.record(ok=True, now=float(i))
    b.record(ok=False, now=9.0)  # 1 of 10 = 10 %: not above the threshold
    assert b.state == CLOSED
    b.record(ok=False, now=10.0)  # 2 of 11 > 10 %
    assert b.state == OPEN and not b.available(now=15.0)
    assert b.available(now=20.0)  # the pause is over: one trial may go
    b.on_send(now=20.0)
    assert b.state == HALF_OPEN and not b.available(now=20.1)  # only one trial at a time
    b.record(ok=True, now=20.5)
    assert b.state == CLOSED and b.available(now=20.6)


def test_a_failed_trial_opens_again_and_old_outcomes_expire() -> None:
    b = CircuitBreaker(window_s=30, min_requests=4, error_rate=0.10, open_s=5)
    for t in range(4):
        b.record(ok=False, now=float(t))
    assert b.state == OPEN
    b.on_send(now=10.0)
    b.record(ok=False, now=10.5)
    assert b.state == OPEN and b.times_opened == 2 and not b.available(now=12.0)
    c = CircuitBreaker(window_s=30, min_requests=4, error_rate=0.10)
    c.record(ok=False, now=0.0)
    for t in range(4):
        c.record(ok=True, now=100.0 + t)  # the early failure left the window
    assert c.state == CLOSED
