"""Per-version outcomes of an endpoint's requests, kept in memory for the canary's SLO gate.

The gateway records each answered request here (`record`: which endpoint and version served it,
whether it failed, its latency: time to first token for a stream, the whole answer otherwise);
the control plane reads a recent window through the `window` verb the composition root hands it
(`core.routing.ReadVersionStats`), and compares a canary's error rate and p95 latency with the
stable version's. Failures are what the replica is to blame for: a 5xx answer, a timeout, a
connection that broke; a client's own 4xx is not one. Bounded: at most `max_samples` outcomes
per version, none older than `horizon_s`. A `listener` (cluster mode: the gateway's
`OutcomeReporter`) hears every versioned outcome too.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from modelyard.core.routing import VersionWindow

# The response header naming the version that served a request.
VERSION_HEADER = "x-modelyard-model-version"

_Outcome = tuple[float, bool, float | None]  # (monotonic time, ok, latency in seconds)


def tag_version(version_id: str | None, headers: dict[str, str]) -> None:
    """Say in the response's headers which version served it (when it has one)."""
    if version_id is not None:
        headers[VERSION_HEADER] = version_id


class VersionStats:
    def __init__(self, horizon_s: float = 3600.0, max_samples: int = 20_000) -> None:
        self.horizon_s = horizon_s
        self.max_samples = max_samples
        self._outcomes: dict[tuple[str, str], deque[_Outcome]] = {}
        self.listener: Callable[[str, str, bool, float | None], None] | None = None

    def record(
        self, endpoint_id: str, version_id: str | None, ok: bool, latency_s: float | None
    ) -> None:
        """One answered request of `version_id` (None: a model served from a path, no version:
        nothing to compare, nothing kept)."""
        if version_id is None:
            return
        if self.listener is not None:
            self.listener(endpoint_id, version_id, ok, latency_s)
        key = (endpoint_id, version_id)
        outcomes = self._outcomes.get(key)
        if outcomes is None:
            outcomes = self._outcomes[key] = deque(maxlen=self.max_samples)
        now = time.monotonic()
        outcomes.append((now, ok, latency_s if ok else None))
        while outcomes and outcomes[0][0] < now - self.horizon_s:
            outcomes.popleft()

    def window(self, endpoint_id: str, version_id: str, window_s: float) -> VersionWindow:
        """The version's outcomes over the last `window_s` seconds."""
        outcomes = self._outcomes.get((endpoint_id, version_id))
        if not outcomes:
            return VersionWindow()
        since = time.monotonic() - window_s
        recent = [o for o in reversed(outcomes) if o[0] >= since]
        errors = sum(not ok for _, ok, _ in recent)
        latencies = sorted(lat for _, ok, lat in recent if ok and lat is not None)
        p95 = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))] if latencies else None
        return VersionWindow(samples=len(recent), errors=errors, p95_s=p95)

    def forget(self, endpoint_id: str) -> None:
        """The endpoint is gone."""
        for key in [k for k in self._outcomes if k[0] == endpoint_id]:
            del self._outcomes[key]
