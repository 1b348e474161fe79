"""What settling one request changes in the limits store, and the change made in one Redis
round trip.

A request's settlement gives back (or takes) the difference between the tokens it reserved
and those it used in its key's TPM bucket (and its tenant's shared one), moves its tenant's
monthly quota counter (one month, or two when it was admitted in one month and finished in the
next) and releases its slot under the tenant's ceiling on requests in flight. `Settlement`
names those changes; the accounting applies them through each limiter, or, when all three live
in one Redis, through `RedisSettlement`: one Lua script instead of three round trips. It writes
the keys `RedisRateLimiter`, `RedisQuotaCounter` and `RedisConcurrencyLimiter` use, with the
same effects as their own calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelyard.core.identity import Limits
from modelyard.gateway.quota import (
    QUOTA_TTL_S,
    RedisConcurrencyLimiter,
    RedisQuotaCounter,
    shared_store,
)
from modelyard.gateway.ratelimit_redis import GIVE_BACK_LUA, RedisRateLimiter


@dataclass
class Settlement:
    """The limits-store changes that settle one request."""

    key_id: str
    limits: Limits
    tenant_id: str
    tokens_back: int = 0  # to the TPM buckets: reserved - used (negative takes more)
    quota_moves: list[tuple[str, int]] = field(default_factory=list)  # (month, tokens)
    slot: tuple[str, str] | None = None  # (scope, slot id) to release

    @property
    def moves_tpm(self) -> bool:
        tenant = self.limits.tenant
        limited = self.limits.tpm is not None or (tenant is not None and tenant.tpm is not None)
        return limited and self.tokens_back != 0


# KEYS: the key's token bucket, its tenant's, the quota counters of two months (the second may
# repeat the first), the tenant's slots. ARGV: the two buckets' tpm (0: no bucket to settle),
# tokens back, quota tokens of each month, the quota ttl, the slot id ('' none).
_SETTLE_LUA = f"""
for i = 1, 2 do
  local bucket, cap, back = KEYS[i], tonumber(ARGV[i]), tonumber(ARGV[3])
  if cap > 0 and back ~= 0 then
{GIVE_BACK_LUA}  end
end
for i = 3, 4 do
  local tokens = tonumber(ARGV[i + 1])
  if tokens ~= 0 then
    redis.call('INCRBY', KEYS[i], tokens)
    redis.call('EXPIRE', KEYS[i], ARGV[6])
  end
end
if ARGV[7] ~= '' then
  redis.call('ZREM', KEYS[5], ARGV[7])
end
return 1
"""


class RedisSettlement:
    """A `Settlement` applied in one Lua script (one round trip instead of three). Like
    `RedisAdmission`, it needs the three in one Redis (or a shard chosen by tenant)."""

    def __init__(
        self, limiter: RedisRateLimiter, quota: RedisQuotaCounter, slots: RedisConcurrencyLimiter
    ) -> None:
        self._limiter, self._quota, self._slots = limiter, quota, slots
        self._settle = quota.redis.register_script(_SETTLE_LUA)

    @shared_store
    async def apply(self, s: Settlement) -> None:
        if len(s.quota_moves) > 2:
            raise ValueError(f"a request settles at most two months, not {s.quota_moves}")
        scope, slot_id = s.slot or ("-", "")
        if not (s.moves_tpm or s.quota_moves or slot_id):
            return
        first_month = s.quota_moves[0][0] if s.quota_moves else "-"
        moves = [*s.quota_moves, (first_month, 0), (first_month, 0)][:2]
        buckets, caps = self._limiter.bucket_keys(s.key_id, s.limits)
        moving = s.moves_tpm
        await self._settle(
            keys=[
                buckets[1],
                buckets[3],
                self._quota.key(s.tenant_id, moves[0][0]),
                self._quota.key(s.tenant_id, moves[1][0]),
                self._slots.key(scope),
            ],
            args=[
                caps[1] if moving else 0,
                caps[3] if moving else 0,
                s.tokens_back,
                moves[0][1],
                moves[1][1],
                QUOTA_TTL_S,
                slot_id,
            ],
        )
