"""The canary's SLO gate: is a canary version worse than the stable one it runs beside?

Each reconcile tick the control plane reads both versions' recent outcomes from the gateway
(`core.routing.ReadVersionStats`: requests answered, failures, p95 latency; time to first token
for streams) over the policy's sliding window and `judge`s them:

- not judged while the canary has fewer than `min_samples` requests in the window;
- rolled back when its error rate exceeds the stable's by more than `max_error_rate_delta`, or
  (both having `min_samples`) its p95 latency is more than `max_p95_ratio` times the stable's;
- otherwise clean: with progressive `steps` (e.g. 5, 25, 50, 100) a clean window at one weight
  moves the canary to the next, and 100 promotes it.

A rollout's canary (`SloPolicy.rollout`) is never judged: it is promoted as soon as it serves
(`control/version_gate.py` decides what each canary's tick does).

Pure: the numbers come in, a `Verdict` (the breach, and the numbers behind it) goes out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from modelyard.config import PlatformSettings
from modelyard.core.errors import Invalid
from modelyard.core.routing import VersionWindow


@dataclass(frozen=True)
class SloPolicy:
    max_error_rate_delta: float
    max_p95_ratio: float
    min_samples: int
    window_s: float
    steps: tuple[int, ...] = ()  # progressive weights, each after a clean window; () = manual
    # A whole-endpoint rollout: a canary at 100 % promoted as soon as a replica of it serves,
    # never judged; it falls back to the stable version if it cannot start.
    rollout: bool = False

    @classmethod
    def defaults(cls, settings: PlatformSettings) -> SloPolicy:
        return cls(
            settings.canary_max_error_rate_delta,
            settings.canary_max_p95_ratio,
            settings.canary_min_samples,
            settings.canary_window_s,
        )

    @classmethod
    def for_rollout(cls, settings: PlatformSettings) -> SloPolicy:
        return replace(cls.defaults(settings), rollout=True)

    @classmethod
    def from_request(
        cls, settings: PlatformSettings, slo: dict[str, Any] | None, steps: list[int] | None
    ) -> SloPolicy:
        """The request's thresholds over the platform's defaults; steps must rise to 100."""
        base = asdict(cls.defaults(settings))
        base.update({k: v for k, v in (slo or {}).items() if v is not None and k != "rollout"})
        clean = tuple(steps or ())
        if clean and (
            list(clean) != sorted(set(clean)) or clean[-1] != 100 or not 0 < clean[0] <= 100
        ):
            raise Invalid(
                "steps must be rising percentages ending at 100, e.g. [5, 25, 50, 100]",
                param="steps",
            )
        base["steps"] = clean
        return cls(**base)

    @classmethod
    def from_json(cls, data: dict[str, Any], settings: PlatformSettings) -> SloPolicy:
        base = asdict(cls.defaults(settings))
        base.update({k: v for k, v in data.items() if k in base})
        base["steps"] = tuple(base.get("steps") or ())
        return cls(**base)

    def view(self) -> dict[str, Any]:
        return {**asdict(self), "steps": list(self.steps)}


@dataclass(frozen=True)
class Verdict:
    judged: bool  # both versions had enough requests in the window to compare
    breach: str | None = None  # why the canary must go back, when it must
    numbers: dict[str, Any] = field(default_factory=dict)


def judge(policy: SloPolicy, canary: VersionWindow, stable: VersionWindow) -> Verdict:
    """Compare the canary's window with the stable's (see the module's docstring)."""
    numbers: dict[str, Any] = {
        "window_s": policy.window_s,
        "canary_requests": canary.samples,
        "canary_errors": canary.errors,
        "canary_error_rate": round(canary.error_rate, 4),
        "stable_requests": stable.samples,
        "stable_errors": stable.errors,
        "stable_error_rate": round(stable.error_rate, 4),
        "canary_p95_ms": _ms(canary.p95_s),
        "stable_p95_ms": _ms(stable.p95_s),
        "max_error_rate_delta": policy.max_error_rate_delta,
        "max_p95_ratio": policy.max_p95_ratio,
    }
    if canary.samples < policy.min_samples:
        return Verdict(False, None, numbers)
    delta = canary.error_rate - stable.error_rate
    numbers["error_rate_delta"] = round(delta, 4)
    if delta > policy.max_error_rate_delta:
        why = (
            f"error rate {canary.error_rate:.1%} over {canary.samples} requests vs the stable "
            f"version's {stable.error_rate:.1%} (more than {policy.max_error_rate_delta:.1%} "
            "worse)"
        )
        return Verdict(True, why, numbers)
    compared = stable.samples >= policy.min_samples
    if compared and canary.p95_s is not None and stable.p95_s:
        ratio = canary.p95_s / stable.p95_s
        numbers["p95_ratio"] = round(ratio, 3)
        if ratio > policy.max_p95_ratio:
            why = (
                f"p95 latency {canary.p95_s * 1000:.0f} ms vs the stable version's "
                f"{stable.p95_s * 1000:.0f} ms ({ratio:.1f}x, more than "
                f"{policy.max_p95_ratio:g}x)"
            )
            return Verdict(True, why, numbers)
    return Verdict(compared, None, numbers)


def next_step(policy: SloPolicy, weight: int) -> int | None:
    """The canary's next weight after a clean window at `weight` (None: no steps, or done)."""
    for step in policy.steps:
        if step > weight:
            return step
    return None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
