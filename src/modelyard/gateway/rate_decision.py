"""What a rate limiter answers: a `Decision` (allowed or why not, and the OpenAI-style
x-ratelimit-* headers that report the buckets), and the `RateLimiter` protocol both bucket
stores (`ratelimit.py` in memory, `ratelimit_redis.py` shared) implement."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from modelyard.core.identity import Limits

# Float refill arithmetic lands a hair short of whole numbers (0.1 * 3 < 0.3); without this
# slack a client that waits exactly retry_after_s could be refused again.
EPS = 1e-9


@dataclass(frozen=True)
class Decision:
    """The outcome of one `acquire`, with what the rate-limit headers report."""

    allowed: bool
    reason: str | None
    retry_after_s: float
    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limited buckets, plus retry-after on refusal."""
        out: dict[str, str] = {}
        for kind, limit, remaining, reset in (
            ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
            ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s),
        ):
            if limit is None:
                continue
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(remaining or 0)
            out[f"x-ratelimit-reset-{kind}"] = format_reset(reset)
        if not self.allowed:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it (Go's style): "250ms", "1.5s", "6m0s",
    "1h2m3s". Rounded up to the millisecond so a client never retries too early."""
    total_ms = max(0, math.ceil(seconds * 1000 - EPS))
    if total_ms == 0:
        return "0s"
    if total_ms < 1000:
        return f"{total_ms}ms"
    hours, rest = divmod(total_ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, millis = divmod(rest, 1000)
    sec_text = f"{secs}.{millis:03d}".rstrip("0") if millis else str(secs)
    if hours:
        return f"{hours}h{minutes}m{sec_text}s"
    if minutes:
        return f"{minutes}m{sec_text}s"
    return f"{sec_text}s"


class RateLimiter(Protocol):
    async def acquire(self, key_id: str, limits: Limits, tokens: int) -> Decision:
        """Take one request and `tokens` tokens from the key's buckets and its tenant's shared
        ones (`Limits.tenant`), all or none."""
        ...

    async def reconcile(self, key_id: str, limits: Limits, reserved: int, actual: int) -> None:
        """Correct the token buckets (the key's and its tenant's) once the real usage of a
        request that reserved `reserved` tokens is known."""
        ...

    async def close(self) -> None: ...


def decision(
    limits: Limits,
    refused: str | None,
    retry_after_s: float,
    levels: Sequence[float | None],
) -> Decision:
    """The headers' view of the buckets after an acquire: `levels` are those of
    `Limits.buckets` (the key's requests and tokens, then its tenant's; None: not limited).
    Each kind reports its tightest bucket: the smallest remainder, the longest reset."""
    caps = [cap for _, _, cap in limits.buckets("")]

    def kind(first: int) -> tuple[int | None, int | None, float]:
        pairs = [
            (caps[i], levels[i])
            for i in (first, first + 2)
            if caps[i] is not None and levels[i] is not None
        ]
        if not pairs:
            return None, None, 0.0
        limit = next(cap for cap in (caps[first], caps[first + 2]) if cap is not None)
        # A debt left by reconcile is internal; clients are told there is nothing left.
        remaining = min(max(0, math.floor(level + EPS)) for _, level in pairs)  # type: ignore[operator]
        reset = max(max(0.0, (cap - level) * 60.0 / cap) for cap, level in pairs)  # type: ignore[operator]
        return limit, remaining, reset

    limit_requests, remaining_requests, reset_requests = kind(0)
    limit_tokens, remaining_tokens, reset_tokens = kind(1)
    return Decision(
        allowed=refused is None,
        reason=refused,
        retry_after_s=retry_after_s,
        limit_requests=limit_requests,
        remaining_requests=remaining_requests,
        reset_requests_s=reset_requests,
        limit_tokens=limit_tokens,
        remaining_tokens=remaining_tokens,
        reset_tokens_s=reset_tokens,
    )


def check_tokens(tokens: int) -> None:
    if tokens < 0:
        raise ValueError(f"tokens must not be negative, got {tokens}")
