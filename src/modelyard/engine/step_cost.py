"""`StepCost`: the engine's measured cost of a step by how many rows it computes, and from it how
many backfill tokens (batch work, the least urgent class) a step may carry beside real-time work.

Each size of step, in rows (tokens computed: a decode row each, a prompt chunk's tokens), keeps a
moving average of its measured time (forward pass and sampling), each observation clipped to
three times the average so far (a one-off stall moves it little). The curve is the machine's own:
on a GPU or wherever a row more costs little, flat; on a 2-core CPU, steep, with the steps where
the matmul changes form (AMX tiles from 8 rows) where they are.

`backfill_tokens(realtime_rows)`: a step computing `realtime_rows` rows of real-time sequences may
carry as many backfill tokens as keep its measured time within `1 + slowdown` of the same step
without them, going up one row at a time while the sizes are measured (interpolating between
measured sizes; none past the largest measured, so nothing is guessed upward). A step with no
real-time rows carries up to `idle_tokens` backfill tokens while real-time work ran in the last
`REALTIME_WINDOW_S` seconds, so that a real-time request arriving meanwhile waits for about one
full decode step at most; an engine serving batch work alone keeps its whole token budget.

Batch work is never starved outright: once backfill has been refused for `MAX_BACKFILL_WAIT_S`
under unbroken real-time traffic, one step carries `idle_tokens` of it, so every batch sequence
moves on at least that often (far inside the worker's no-progress limit) at the cost of one
slower real-time step in that many seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ALPHA = 0.1  # weight of the newest observation of a size
CLIP = 3.0  # an observation counts at most this many times the average so far
REALTIME_WINDOW_S = 30.0  # real-time work this recent keeps steps of batch alone short
MAX_BACKFILL_WAIT_S = 2.0  # refused this long, backfill rides in the next step all the same


@dataclass
class StepCost:
    slowdown: float = 0.1
    idle_tokens: int = 16
    _seconds: dict[int, float] = field(default_factory=dict)  # rows -> moving average
    clock: Callable[[], float] = time.monotonic
    _realtime_at: float = -math.inf  # when a step last computed real-time rows
    _refused_since: float | None = None  # backfill refused beside real-time work since then

    def saw_realtime(self) -> None:
        self._realtime_at = self.clock()

    def observe(self, rows: int, seconds: float) -> None:
        """A step of `rows` rows took `seconds`."""
        if rows <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        old = self._seconds.get(rows)
        if old is None:
            self._seconds[rows] = seconds
        else:
            self._seconds[rows] = old + ALPHA * (min(seconds, CLIP * old) - old)

    def seconds(self, rows: int) -> float | None:
        """The measured (or, between two measured sizes, interpolated) time of a step of
        `rows` rows; None past the largest measured size or below the smallest."""
        known = self._seconds.get(rows)
        if known is not None:
            return known
        below = max((n for n in self._seconds if n < rows), default=None)
        above = min((n for n in self._seconds if n > rows), default=None)
        if below is None or above is None:
            return None
        lo, hi = self._seconds[below], self._seconds[above]
        return lo + (hi - lo) * (rows - below) / (above - below)

    def backfill_tokens(self, realtime_rows: int) -> int:
        """The backfill tokens a step with `realtime_rows` real-time rows may carry (asked
        when there is backfill work to schedule)."""
        now = self.clock()
        if realtime_rows <= 0:
            self._refused_since = None
            recent = now - self._realtime_at < REALTIME_WINDOW_S
            return self.idle_tokens if recent else 1 << 30
        allowed = self._beside(realtime_rows)
        if allowed > 0:
            self._refused_since = None
            return allowed
        if self._refused_since is None:
            self._refused_since = now
        elif now - self._refused_since >= MAX_BACKFILL_WAIT_S:
            self._refused_since = None
            return self.idle_tokens
        return 0

    def _beside(self, realtime_rows: int) -> int:
        alone = self.seconds(realtime_rows)
        if alone is None:
            return 0  # not measured yet: real-time steps carry no backfill
        bound = (1.0 + self.slowdown) * alone
        extra = 0
        while extra < self.idle_tokens:
            cost = self.seconds(realtime_rows + extra + 1)
            if cost is None or cost > bound:
                break
            extra += 1
        return extra
