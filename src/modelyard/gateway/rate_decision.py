"""What a rate limiter answers: a `Decision` (allowed or why not, and the OpenAI-style
x-ratelimit-* headers that report the buckets), and the `RateLimiter` protocol both bucket
stores (`ratelimit.py` in memory, `ratelimit_redis.py` shared) implement."""

from __future__ import annotations

import math
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
        """Take one request and `tokens` tokens from the key's buckets, both or neither."""
        ...

    async def reconcile(self, key_id: str, limits: Limits, reserved: int, actual: int) -> None:
        """Correct the token bucket once the real usage of a request that reserved
        `reserved` tokens is known."""
        ...

    async def close(self) -> None: ...


def decision(
    limits: Limits,
    refused: str | None,
    retry_after_s: float,
    requests_level: float | None,
    tokens_level: float | None,
) -> Decision:
    def remaining(level: float | None) -> int | None:
        # A debt left by reconcile is internal; clients are told there is nothing left.
        return None if level is None else max(0, math.floor(level + EPS))

    def reset(limit: int | None, level: float | None) -> float:
        if limit is None or level is None:
            return 0.0
        return max(0.0, (limit - level) * 60.0 / limit)

    return Decision(
        allowed=refused is None,
        reason=refused,
        retry_after_s=retry_after_s,
        limit_requests=limits.rpm,
        remaining_requests=remaining(requests_level),
        reset_requests_s=reset(limits.rpm, requests_level),
        limit_tokens=limits.tpm,
        remaining_tokens=remaining(tokens_level),
        reset_tokens_s=reset(limits.tpm, tokens_level),
    )


def check_tokens(tokens: int) -> None:
    if tokens < 0:
        raise ValueError(f"tokens must not be negative, got {tokens}")
