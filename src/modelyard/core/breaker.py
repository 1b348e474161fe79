"""A circuit breaker per replica: stop sending requests to a replica that keeps failing.

Closed: requests flow; outcomes are kept for `window_s`. When at least `min_requests` outcomes
show an error rate above `error_rate` (the spec's 10 %), the breaker opens: the replica gets no
requests for `open_s`. Then it is half-open: one trial request goes through; success closes the
breaker, failure opens it again. Failures are connection errors, timeouts and 5xx answers, not
a client's own 4xx.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass
class CircuitBreaker:
    window_s: float = 30.0
    min_requests: int = 10
    error_rate: float = 0.10
    open_s: float = 10.0
    state: str = CLOSED
    opened_at: float = 0.0
    trial_in_flight: bool = False
    times_opened: int = 0
    _outcomes: deque[tuple[float, bool]] = field(default_factory=deque)

    def available(self, now: float | None = None) -> bool:
        """Whether a request may go to this replica now (no side effect)."""
        now = time.monotonic() if now is None else now
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return now - self.opened_at >= self.open_s
        return not self.trial_in_flight

    def on_send(self, now: float | None = None) -> None:
        """A request is going out: an open breaker past its pause sends its one trial."""
        now = time.monotonic() if now is None else now
        if self.state == OPEN and now - self.opened_at >= self.open_s:
            self.state = HALF_OPEN
        if self.state == HALF_OPEN:
            self.trial_in_flight = True

    def record(self, ok: bool, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.state == HALF_OPEN:
            self.trial_in_flight = False
            if ok:
                self.state = CLOSED
                self._outcomes.clear()
            else:
                self._open(now)
            return
        self._outcomes.append((now, ok))
        while self._outcomes and self._outcomes[0][0] < now - self.window_s:
            self._outcomes.popleft()
        if self.state == CLOSED and len(self._outcomes) >= self.min_requests:
            errors = sum(1 for _, good in self._outcomes if not good)
            if errors / len(self._outcomes) > self.error_rate:
                self._open(now)

    def _open(self, now: float) -> None:
        self.state = OPEN
        self.opened_at = now
        self.times_opened += 1
        self._outcomes.clear()
