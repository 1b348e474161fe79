"""What becomes of an endpoint's canary at a tick: the gate's `decide` reads the canary, its
replicas and (for a judged canary) both versions' recent outcomes, and returns a `Decision`
that `Versions.tick` (control/versions.py) carries out with its verbs.

- A canary that failed to start `rollout_attempts` times is rolled back; a rollout's canary
  falls back (the same rollback), naming the last good version, when the stable version served.
- A rollout's canary (`SloPolicy.rollout`, a canary at 100 %) is promoted as soon as a replica
  of it serves; it is never judged.
- Any other canary is judged against the stable version (`canary.judge`): a breach rolls it
  back with the numbers; a clean window moves it to its next step, and step 100 promotes it.

Pure: nothing is changed here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from modelyard.control.canary import Verdict, judge, next_step
from modelyard.control.state import EndpointState
from modelyard.control.version_tracks import Track
from modelyard.core.routing import ReadVersionStats
from modelyard.core.status import ReplicaState


class Move(StrEnum):
    WAIT = "wait"
    ROLL_BACK = "roll_back"  # a canary that breached its SLO or cannot start
    FALL_BACK = "fall_back"  # a rollout that cannot start: the stable version stays
    PROMOTE = "promote"
    STEP = "step"  # the canary's next progressive weight


@dataclass(frozen=True)
class Decision:
    move: Move
    reason: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)
    weight: int = 0  # STEP: the canary's weight from now on
    verdict: Verdict | None = None  # what judging it found, when it was judged


WAIT = Decision(Move.WAIT)


def decide(
    state: EndpointState, canary: Track, attempts: int, read_stats: ReadVersionStats | None
) -> Decision:
    """The gate's move for `canary` now (see the module's docstring)."""
    if canary.failures >= attempts:
        why = state.last_error or "it failed to load"
        if not canary.slo.rollout:
            return Decision(
                Move.ROLL_BACK, f"the canary failed to start {canary.failures} times ({why})"
            )
        if state.row.good_version_id != state.row.version_id:
            return WAIT  # the stable version never served either: nothing to fall back to
        return Decision(
            Move.FALL_BACK,
            f"version {canary.version_id} failed to load {attempts} times ({why[:300]}); "
            f"serving the last good version {state.row.artifact}",
        )
    if canary.slo.rollout:
        serving = any(
            r.version_id == canary.version_id and r.state is ReplicaState.READY
            for r in state.replicas
        )
        return Decision(Move.PROMOTE) if serving else WAIT
    if read_stats is None or state.row.version_id is None:
        return WAIT
    # Only this canary's own requests: an earlier run of the same version is not its record.
    window = min(canary.slo.window_s, max(0.001, time.monotonic() - canary.since))
    verdict = judge(
        canary.slo,
        read_stats(state.row.id, canary.version_id, window),
        read_stats(state.row.id, state.row.version_id, window),
    )
    if verdict.breach is not None:
        return Decision(
            Move.ROLL_BACK, f"SLO breached: {verdict.breach}", verdict.numbers, verdict=verdict
        )
    clean_window = time.monotonic() - canary.weight_since >= canary.slo.window_s
    step = next_step(canary.slo, canary.weight)
    if not (verdict.judged and clean_window and canary.slo.steps):
        return Decision(Move.WAIT, verdict=verdict)
    if step is None or step >= 100:
        return Decision(Move.PROMOTE, verdict=verdict)
    return Decision(Move.STEP, weight=step, verdict=verdict)
