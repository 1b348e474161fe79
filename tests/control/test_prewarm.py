"""Predictive pre-warming with an injected clock: the hour-of-week history of an endpoint's
requests wakes it before its usual traffic, not at other times."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from modelyard.control.prewarm import TrafficHistory, hour_of_week, should_prewarm

MONDAY_9AM = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)  # a Monday


def ts(dt: datetime) -> float:
    return dt.timestamp()


def test_hour_of_week_and_week_change_at_monday_midnight() -> None:
    week, how = hour_of_week(ts(MONDAY_9AM))
    assert how == 9
    sunday_late = MONDAY_9AM - timedelta(hours=9, seconds=1)
    assert hour_of_week(ts(sunday_late)) == (week - 1, 6 * 24 + 23)
    assert hour_of_week(ts(MONDAY_9AM + timedelta(days=1)))[1] == 24 + 9


def test_weekly_traffic_wakes_the_endpoint_five_minutes_early(tmp_path: Path) -> None:
    history = TrafficHistory(weeks=4)
    for week in range(3):
        start = MONDAY_9AM + timedelta(weeks=week)
        for minute in range(0, 60, 3):  # 20 requests every Monday 9-10am
            history.record("ep-1", ts(start + timedelta(minutes=minute)))
    fourth_monday = MONDAY_9AM + timedelta(weeks=3)
    before = fourth_monday - timedelta(minutes=4)  # 08:56: 9:01 is within the lead time
    assert should_prewarm(history, "ep-1", ts(before), lead_s=300, min_requests=5) == 20
    assert should_prewarm(history, "ep-1", ts(before - timedelta(hours=2)), 300, 5) is None
    tuesday = before + timedelta(days=1)
    assert should_prewarm(history, "ep-1", ts(tuesday), 300, 5) is None
    assert should_prewarm(history, "ep-other", ts(before), 300, 5) is None
    # The history survives a restart.
    path = tmp_path / "history.json"
    history.save(path)
    again = TrafficHistory(weeks=4)
    again.load(path)
    assert again.expected("ep-1", ts(fourth_monday)) == history.expected("ep-1", ts(fourth_monday))


def test_old_weeks_fade_out() -> None:
    history = TrafficHistory(weeks=2)
    for _ in range(30):
        history.record("ep", ts(MONDAY_9AM))
    assert history.expected("ep", ts(MONDAY_9AM + timedelta(weeks=1))) == 30
    assert history.expected("ep", ts(MONDAY_9AM + timedelta(weeks=2))) == 15  # one quiet week
    assert history.expected("ep", ts(MONDAY_9AM + timedelta(weeks=3))) == 0
