"""Per-version request outcomes as counters every gateway adds to and the leading controller
sums (cluster mode: the canary's SLO gate sees every gateway's requests, not only its own).

One Redis hash per endpoint version and `OUTCOME_BUCKET_S` of wall-clock time
(`cluster_keys.OUTCOMES_PREFIX`): `n` requests answered, `e` of them failed, and the good ones'
latencies as a histogram, field `l<i>` counting latencies in geometric bin `i` (each bin 10 %
wider than the one before, from 1 ms): a p95 read from the sum of the gateways' histograms is
within 10 % of the exact one. Kept `OUTCOME_TTL_S` (the longest SLO window judged).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from modelyard.core.cluster_keys import OUTCOMES_PREFIX
from modelyard.core.routing import VersionWindow

OUTCOME_BUCKET_S = 5
OUTCOME_TTL_S = 3600 + 2 * OUTCOME_BUCKET_S
_RATIO = 1.1
_MAX_BIN = 140  # 1.1 ** 140 ms: about 10 minutes


def bucket_of(epoch_s: float) -> int:
    return int(epoch_s // OUTCOME_BUCKET_S)


def outcome_key(endpoint_id: str, version_id: str, bucket: int) -> str:
    return f"{OUTCOMES_PREFIX}{endpoint_id}:{version_id}:{bucket}"


def latency_bin(latency_s: float) -> int:
    ms = max(latency_s * 1000.0, 1.0)
    return min(_MAX_BIN, math.ceil(math.log(ms) / math.log(_RATIO) - 1e-9))


def bin_upper_s(i: int) -> float:
    """The largest latency bin `i` holds, in seconds."""
    return _RATIO**i / 1000.0


@dataclass
class OutcomeCounts:
    """One version's outcomes over some buckets (a gateway's pending ones, or a sum)."""

    answered: int = 0
    failed: int = 0
    bins: Counter[int] = field(default_factory=Counter)

    def add(self, ok: bool, latency_s: float | None) -> None:
        self.answered += 1
        if not ok:
            self.failed += 1
        elif latency_s is not None:
            self.bins[latency_bin(latency_s)] += 1

    def fields(self) -> dict[str, int]:
        """The hash fields to add (HINCRBY) for these counts."""
        out = {"n": self.answered, "e": self.failed}
        out.update({f"l{i}": c for i, c in self.bins.items()})
        return {k: v for k, v in out.items() if v}

    @classmethod
    def parse(cls, raw: dict[bytes | str, bytes | str]) -> OutcomeCounts:
        counts = cls()
        for key, value in raw.items():
            name = key.decode() if isinstance(key, bytes) else key
            n = int(value)
            if name == "n":
                counts.answered = n
            elif name == "e":
                counts.failed = n
            elif name.startswith("l") and name[1:].isdigit():
                counts.bins[int(name[1:])] = n
        return counts

    def merge(self, other: OutcomeCounts) -> None:
        self.answered += other.answered
        self.failed += other.failed
        self.bins.update(other.bins)

    def window(self) -> VersionWindow:
        """The SLO gate's view: requests, failures, p95 of the good ones (a bin's upper bound,
        at the same rank `gateway/version_stats.py` takes)."""
        good = sum(self.bins.values())
        p95 = None
        if good:
            rank, seen = min(good - 1, int(0.95 * good)), 0
            for i in sorted(self.bins):
                seen += self.bins[i]
                if seen > rank:
                    p95 = bin_upper_s(i)
                    break
        return VersionWindow(samples=self.answered, errors=self.failed, p95_s=p95)
