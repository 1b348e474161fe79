"""Predictive pre-warming: wake an idle endpoint before the traffic it usually gets.

Each endpoint's requests are counted per hour of the week (168 buckets) over the last
`weeks` weeks. An endpoint at zero replicas whose expected requests in the hour starting
`lead_s` from now reach `min_requests` is woken up ahead of them ("this model is requested every
weekday at 9am"). The clock is always passed in, so tests and the fleet simulator drive it.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

WEEK_S = 7 * 24 * 3600


def hour_of_week(at: float) -> tuple[int, int]:
    """(week number, hour of that week, Monday 00:00 UTC = 0) of a unix time."""
    # The same for every moment of an hour: computed once per hour, not once per endpoint and
    # tick (the controller's tick records all of them within the same hour).
    return _hour_of_week(int(at // 3600))


@functools.lru_cache(maxsize=64)
def _hour_of_week(hour: int) -> tuple[int, int]:
    at = hour * 3600
    ts = datetime.fromtimestamp(at, UTC)
    monday_based = ts.weekday() * 24 + ts.hour
    # Weeks counted from a Monday, so a week number changes exactly at Monday 00:00.
    week = int(
        (at - (ts.weekday() * 86400 + ts.hour * 3600 + ts.minute * 60 + ts.second)) // WEEK_S
    )
    return week, monday_based


class TrafficHistory:
    def __init__(self, weeks: int = 4) -> None:
        self.weeks = weeks
        # endpoint → hour of week → {week number: requests}
        self._counts: dict[str, dict[int, dict[int, int]]] = defaultdict(lambda: defaultdict(dict))
        self._first_week: dict[str, int] = {}
        # The requests of the hour being recorded (`_hour`, hours since the epoch), per
        # endpoint, added to `_counts` when another hour is recorded or the history is read:
        # the controller records every endpoint each tick, and one flat dict is one lookup
        # where `_counts` takes three (this is on its 10,000-endpoint pass).
        self._hour: int | None = None
        self._pending: dict[str, int] = {}

    def record(self, endpoint_id: str, at: float, requests: int = 1) -> None:
        if requests <= 0:
            return
        hour = int(at // 3600)
        if hour != self._hour:
            self._flush()
            self._hour = hour
        pending = self._pending
        pending[endpoint_id] = pending.get(endpoint_id, 0) + requests

    def _flush(self) -> None:
        """Add the pending hour's requests to the weekly counts."""
        if self._hour is None or not self._pending:
            return
        week, how = _hour_of_week(self._hour)
        for endpoint_id, requests in self._pending.items():
            self._first_week.setdefault(endpoint_id, week)
            per_week = self._counts[endpoint_id][how]
            if week in per_week:
                per_week[week] += requests
                continue
            per_week[week] = requests
            for old in [w for w in per_week if w <= week - self.weeks]:
                del per_week[old]
        self._pending = {}

    def expected(self, endpoint_id: str, at: float) -> float:
        """Mean requests in that hour of the week over the past weeks seen (this week excluded)."""
        self._flush()
        week, how = hour_of_week(at)
        first = self._first_week.get(endpoint_id)
        if first is None or first >= week:
            return 0.0
        past = range(max(first, week - self.weeks), week)
        counts = self._counts[endpoint_id].get(how, {})
        return sum(counts.get(w, 0) for w in past) / len(past)

    def save(self, path: Path) -> None:
        self._flush()
        data = {
            ep: {"first": self._first_week.get(ep), "hours": {h: c for h, c in hours.items()}}
            for ep, hours in self._counts.items()
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)

    def load(self, path: Path) -> None:
        self._flush()  # what was recorded before the load counts before it, as it always did
        if not path.exists():
            return
        for ep, entry in json.loads(path.read_text()).items():
            if entry.get("first") is not None:
                self._first_week[ep] = int(entry["first"])
            for how, per_week in entry.get("hours", {}).items():
                self._counts[ep][int(how)] = {int(w): int(n) for w, n in per_week.items()}


def should_prewarm(
    history: TrafficHistory, endpoint_id: str, now: float, lead_s: float, min_requests: float
) -> float | None:
    """The requests expected in the hour `lead_s` from now, if that is enough to wake up for."""
    expected = history.expected(endpoint_id, now + lead_s)
    return expected if expected >= min_requests else None
