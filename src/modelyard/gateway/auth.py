"""API keys: generation, hashing, and authenticating a request's bearer key to a `Principal`.

Keys are random (256 bits), shown once, stored only as their sha256; the lookup goes by hash
and the final comparison is constant-time. Lookups are cached for a few seconds; revocation in
this process invalidates the cache at once. The cache is bounded (least recently used first
out), and unknown keys go to a smaller cache of their own, so a flood of random keys costs
database lookups but neither memory nor the cached entries of real keys.

With the database unreachable, a key looked up successfully within the last `stale_ttl_s`
(default 5 minutes) is still served from that lookup, so an outage does not stop traffic that
was flowing. The trade-off: a key revoked (or limited) by another gateway process meanwhile is
honoured only when the database answers again, at most `stale_ttl_s` late; a revocation in
this process still takes effect at once. A key with no good lookup in that window (unknown,
new, or seen too long ago) is refused with a 503 `auth_unavailable` and Retry-After, never
served unchecked and never a 500.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from modelyard.api.errors import APIError
from modelyard.gateway.ratelimit import Limits
from modelyard.store import repository as repo
from modelyard.store.db import Database

log = logging.getLogger(__name__)

KEY_PREFIX = "sk-my-"
# What a lookup raises when the database cannot be reached (not when a query is wrong).
_UNREACHABLE = (OperationalError, InterfaceError, PoolTimeout, OSError)
_RETRY_AFTER_S = 5
SCOPES = ("inference", "admin")


def generate_key() -> tuple[str, str, str]:
    """A new key: (the key itself, its stored hash, a displayable prefix)."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, hash_key(key), key[: len(KEY_PREFIX) + 4]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Tier(StrEnum):
    """A tenant's service tier, set by the platform admin: under overload the lower tier waits
    (or is refused) first, in the admission queue and in the engine."""

    FREE = "free"
    STANDARD = "standard"
    PRIORITY = "priority"

    @property
    def rank(self) -> int:
        """0 is served first: the engine priority of the tier's interactive requests."""
        return _TIER_RANK[self]


_TIER_RANK = {Tier.PRIORITY: 0, Tier.STANDARD: 1, Tier.FREE: 2}


@dataclass(frozen=True)
class Principal:
    key_id: str
    key_name: str
    tenant_id: str
    tenant_name: str
    scopes: frozenset[str]
    limits: Limits
    monthly_token_quota: int | None
    platform_admin: bool  # an admin key of the system tenant: operates the whole platform
    tier: Tier = Tier.STANDARD
    # The tenant's ceilings on work in flight (None: no ceiling), set by the platform admin.
    max_concurrent_requests: int | None = None
    max_concurrent_batch_items: int | None = None

    def require(self, scope: str) -> None:
        if scope not in self.scopes:
            raise APIError(
                403,
                f"This API key lacks the '{scope}' scope required for this operation.",
                code="insufficient_scope",
            )

    def require_platform_admin(self) -> None:
        if not self.platform_admin:
            raise APIError(
                403, "Only the platform administrator can do this.", code="insufficient_scope"
            )

    def tenant_filter(self, requested: str | None = None) -> str | None:
        """The tenant whose data a call may see: its own, or any one the platform admin names."""
        if self.platform_admin:
            return requested
        if requested is not None and requested != self.tenant_id:
            raise APIError(404, "No such tenant.", code="not_found")
        return self.tenant_id


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key")


def _capped(key_limit: int | None, ceiling: int | None) -> int | None:
    """A key's limit within its tenant's ceiling: a key may be tighter, never looser."""
    if ceiling is None:
        return key_limit
    return ceiling if key_limit is None else min(key_limit, ceiling)


class _LRU:
    """A cache of key hash → (lookup, expiry, time of the lookup) of at most `size` entries.
    An expired entry stays (until pushed out) as the fallback while the database is down."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[str, tuple[Principal | None, float, float]] = OrderedDict()

    def get(self, key_hash: str, now: float) -> tuple[Principal | None] | None:
        entry = self._entries.get(key_hash)
        if entry is None or entry[1] <= now:
            return None
        self._entries.move_to_end(key_hash)
        return (entry[0],)

    def last_good(self, key_hash: str, since: float) -> tuple[Principal | None, float] | None:
        """The entry's lookup and its time, if it was looked up at `since` or later."""
        entry = self._entries.get(key_hash)
        if entry is None or entry[2] < since:
            return None
        return entry[0], entry[2]

    def put(self, key_hash: str, principal: Principal | None, expires: float, at: float) -> None:
        self._entries[key_hash] = (principal, expires, at)
        self._entries.move_to_end(key_hash)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class Authenticator:
    def __init__(
        self,
        db: Database,
        cache_ttl_s: float = 5.0,
        cache_size: int = 10_000,
        negative_cache_size: int = 1_000,
        stale_ttl_s: float = 300.0,
        lookup_timeout_s: float = 3.0,
    ) -> None:
        self.db = db
        self.cache_ttl_s = cache_ttl_s
        self.stale_ttl_s = stale_ttl_s
        # A database that hangs (not refusing: unreachable host, stuck server) counts as down
        # after this long, so requests fall back instead of waiting on the connect timeout.
        self.lookup_timeout_s = lookup_timeout_s
        self._outage = False  # logged once per outage, not per request
        self._known = _LRU(cache_size)
        self._unknown = _LRU(negative_cache_size)

    @property
    def cached(self) -> int:
        """Entries in the caches (known and unknown keys together)."""
        return len(self._known) + len(self._unknown)

    def _lookup(self, key_hash: str) -> Principal | None:
        with self.db.session() as s:
            key = repo.key_by_hash(s, key_hash)
            if key is None or key.revoked_at is not None:
                return None
            if not hmac.compare_digest(key.key_hash, key_hash):
                return None
            tenant = repo.get_tenant(s, key.tenant_id)
            assert tenant is not None
            scopes = frozenset(filter(None, key.scopes.split(",")))
            return Principal(
                key_id=key.id,
                key_name=key.name,
                tenant_id=tenant.id,
                tenant_name=tenant.name,
                scopes=scopes,
                limits=Limits(
                    rpm=_capped(key.rpm_limit, tenant.max_rpm),
                    tpm=_capped(key.tpm_limit, tenant.max_tpm),
                ),
                monthly_token_quota=tenant.monthly_token_quota,
                platform_admin=tenant.is_system and "admin" in scopes,
                tier=Tier(tenant.tier or Tier.STANDARD),
                max_concurrent_requests=tenant.max_concurrent_requests,
                max_concurrent_batch_items=tenant.max_concurrent_batch_items,
            )

    async def authenticate(self, authorization: str | None) -> Principal:
        if not authorization:
            raise _unauthorized(
                "You didn't provide an API key. Provide it in the Authorization header "
                "(Authorization: Bearer YOUR_KEY)."
            )
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("The Authorization header must be 'Bearer YOUR_KEY'.")
        key_hash = hash_key(key.strip())
        now = time.monotonic()
        cached = self._known.get(key_hash, now) or self._unknown.get(key_hash, now)
        if cached is not None:
            principal = cached[0]
        else:
            try:
                principal = await asyncio.wait_for(
                    asyncio.to_thread(self._lookup, key_hash), self.lookup_timeout_s
                )
            except _UNREACHABLE as exc:  # TimeoutError is an OSError
                principal = self._last_good(key_hash, now, exc)
            else:
                if self._outage:
                    log.warning("key lookups work again")
                    self._outage = False
                cache = self._unknown if principal is None else self._known
                cache.put(key_hash, principal, now + self.cache_ttl_s, now)
        if principal is None:
            shown = key.strip()[:10] + "…" if len(key.strip()) > 10 else "…"
            raise _unauthorized(f"Incorrect API key provided: {shown}. It may have been revoked.")
        return principal

    def _last_good(self, key_hash: str, now: float, exc: Exception) -> Principal:
        """The database is unreachable: the key's last good lookup if recent enough, else 503."""
        if not self._outage:
            log.warning("the database is unreachable for key lookups (%s); serving keys looked "
                        "up in the last %gs from cache", str(exc) or repr(exc),
                        self.stale_ttl_s)  # fmt: skip
            self._outage = True
        found = self._known.last_good(key_hash, now - self.stale_ttl_s)
        if found is None or found[0] is None:
            raise APIError(
                503,
                "API keys cannot be checked right now (the platform's database is unreachable); "
                f"please retry in {_RETRY_AFTER_S}s.",
                code="auth_unavailable",
                headers={"retry-after": str(_RETRY_AFTER_S)},
            )
        principal, looked_up = found
        # Tried again after one cache period, not on every request of the outage.
        self._known.put(key_hash, principal, now + self.cache_ttl_s, looked_up)
        return principal

    def invalidate(self) -> None:
        """Forget every cached lookup (after a key is revoked or its limits change)."""
        self._known.clear()
        self._unknown.clear()
