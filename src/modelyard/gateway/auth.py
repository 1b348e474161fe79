"""API keys: generation, hashing, and authenticating a request's bearer key to a `Principal`.

A bearer is an API key (`sk-my-…`; a user's key is cut to the user's role) or a console
session a user began with single sign-on (`sk-my-session-…`, until it expires); both are
stored only as their sha256 and looked up the same way.

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

Expiry and rotation: a key past its `expires_at` is refused (401 `key_expired`) from the
moment it expires, cached or not (the lookup carries the time). A rotated key's old secret is
accepted until the end of the grace period the rotation gave it, then refused the same way.
Changing a key's expiry, allowed models or limits, or rotating it, takes effect at once in the
gateway that made the change and within `cache_ttl_s` (the `auth_cache_ttl_s` setting) in
every other one.

Last use: a key's `last_used_at` is kept in memory as requests pass and written by one
background round every `last_used_every_s` (one UPDATE per key used meanwhile), never on the
request's path.
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
from datetime import UTC, datetime

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from modelyard.core.errors import Unauthorized, Unavailable
from modelyard.core.identity import Principal
from modelyard.core.periodic import Periodic
from modelyard.gateway.metrics import REQUEST_TENANT
from modelyard.store import people
from modelyard.store import repository as repo
from modelyard.store.db import Database

log = logging.getLogger(__name__)

KEY_PREFIX = "sk-my-"
SESSION_PREFIX = "sk-my-session-"
# What a lookup raises when the database cannot be reached (not when a query is wrong).
_UNREACHABLE = (OperationalError, InterfaceError, PoolTimeout, OSError)
_RETRY_AFTER_S = 5


def generate_key() -> tuple[str, str, str]:
    """A new key: (the key itself, its stored hash, a displayable prefix)."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, hash_key(key), key[: len(KEY_PREFIX) + 4]


def generate_session_token() -> tuple[str, str]:
    """A new console session's bearer token and its stored hash."""
    token = SESSION_PREFIX + secrets.token_urlsafe(32)
    return token, hash_key(token)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _unauthorized(message: str) -> Unauthorized:
    return Unauthorized(message, code="invalid_api_key")


@dataclass(frozen=True)
class _Access:
    """A key's lookup: who it is, and until when (unix seconds; None: no end) the secret that
    was presented works. `rotated`: it is the secret a rotation replaced."""

    principal: Principal
    not_after: float | None = None
    rotated: bool = False


def _ts(value: datetime | None) -> float | None:
    return None if value is None else repo.as_utc(value).timestamp()


def _earliest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


def _expired(access: _Access) -> Unauthorized:
    assert access.not_after is not None
    at = datetime.fromtimestamp(access.not_after, UTC).isoformat(timespec="seconds")
    if access.rotated:
        message = f"This API key was rotated and its grace period ended at {at}; use the new key."
    else:
        message = f"This API key expired at {at}; an admin can extend it or make a new key."
    return Unauthorized(message, code="key_expired")


class _LRU:
    """A cache of key hash → (lookup, expiry, time of the lookup) of at most `size` entries.
    An expired entry stays (until pushed out) as the fallback while the database is down."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[str, tuple[_Access | None, float, float]] = OrderedDict()

    def get(self, key_hash: str, now: float) -> tuple[_Access | None] | None:
        entry = self._entries.get(key_hash)
        if entry is None or entry[1] <= now:
            return None
        self._entries.move_to_end(key_hash)
        return (entry[0],)

    def last_good(self, key_hash: str, since: float) -> tuple[_Access | None, float] | None:
        """The entry's lookup and its time, if it was looked up at `since` or later."""
        entry = self._entries.get(key_hash)
        if entry is None or entry[2] < since:
            return None
        return entry[0], entry[2]

    def put(self, key_hash: str, principal: _Access | None, expires: float, at: float) -> None:
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
        last_used_every_s: float = 60.0,
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
        # key id -> when it was last used here (unix seconds), not yet written; at most as many
        # keys as the cache holds.
        self._used: dict[str, float] = {}
        self._used_cap = cache_size
        self._last_used = Periodic(
            self.flush_last_used, last_used_every_s, "keys-last-used",
            "writing keys' last use failed", log, wait_first=True,
        )  # fmt: skip

    def start(self) -> None:
        self._last_used.start()

    async def stop(self) -> None:
        await self._last_used.stop()
        try:
            await self.flush_last_used()
        except Exception as exc:
            log.warning("writing keys' last use failed: %s", exc)

    @property
    def cached(self) -> int:
        """Entries in the caches (known and unknown keys together)."""
        return len(self._known) + len(self._unknown)

    def _lookup(self, key_hash: str) -> _Access | None:
        # A read: run again on a fresh connection if the database failed over under it.
        return self.db.read(lambda s: self._lookup_in(s, key_hash))

    @staticmethod
    def _lookup_in(s: Session, key_hash: str) -> _Access | None:
        key = repo.key_by_hash(s, key_hash)
        if key is None:
            return Authenticator._session_in(s, key_hash)
        if key.revoked_at is not None:
            return None
        if hmac.compare_digest(key.key_hash, key_hash):
            not_after, rotated = _ts(key.expires_at), False
        elif key.previous_key_hash and hmac.compare_digest(key.previous_key_hash, key_hash):
            # The secret a rotation replaced: until its grace ends (or the key expires).
            grace = _ts(key.previous_key_expires_at) or 0.0
            not_after, rotated = _earliest(grace, _ts(key.expires_at)), True
        else:
            return None
        tenant = repo.get_tenant(s, key.tenant_id)
        assert tenant is not None
        user = None
        if key.owner_user_id is not None:
            user = people.get_user(s, key.tenant_id, key.owner_user_id)
            if user is None:
                return None
        return _Access(Principal.for_key(key, tenant, user), not_after, rotated)

    @staticmethod
    def _session_in(s: Session, token_hash: str) -> _Access | None:
        """A console session (single sign-on) by its token's hash, valid until it expires."""
        session = people.session_by_hash(s, token_hash)
        if session is None or repo.as_utc(session.expires_at) <= repo.now():
            return None
        if not hmac.compare_digest(session.token_hash, token_hash):
            return None
        user = people.get_user(s, None, session.user_id)
        if user is None:
            return None
        tenant = repo.get_tenant(s, user.tenant_id)
        assert tenant is not None
        return _Access(Principal.for_session(session, user, tenant), _ts(session.expires_at))

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
            access = cached[0]
        else:
            try:
                access = await asyncio.wait_for(
                    asyncio.to_thread(self._lookup, key_hash), self.lookup_timeout_s
                )
            except _UNREACHABLE as exc:  # TimeoutError is an OSError
                access = self._last_good(key_hash, now, exc)
            else:
                if self._outage:
                    log.warning("key lookups work again")
                    self._outage = False
                cache = self._unknown if access is None else self._known
                cache.put(key_hash, access, now + self.cache_ttl_s, now)
        if access is None:
            shown = key.strip()[:10] + "…" if len(key.strip()) > 10 else "…"
            raise _unauthorized(f"Incorrect API key provided: {shown}. It may have been revoked.")
        wall = time.time()
        if access.not_after is not None and wall >= access.not_after:
            raise _expired(access)
        principal = access.principal
        if principal.key_id in self._used or len(self._used) < self._used_cap:
            self._used[principal.key_id] = wall
        REQUEST_TENANT.set(principal.tenant_id)  # the label of this request's refusals, if any
        return principal

    def _last_good(self, key_hash: str, now: float, exc: Exception) -> _Access:
        """The database is unreachable: the key's last good lookup if recent enough, else 503."""
        if not self._outage:
            log.warning("the database is unreachable for key lookups (%s); serving keys looked "
                        "up in the last %gs from cache", str(exc) or repr(exc),
                        self.stale_ttl_s)  # fmt: skip
            self._outage = True
        found = self._known.last_good(key_hash, now - self.stale_ttl_s)
        access = None if found is None else found[0]
        if found is None or access is None:
            raise Unavailable(
                "API keys cannot be checked right now (the platform's database is unreachable); "
                f"please retry in {_RETRY_AFTER_S}s.",
                code="auth_unavailable",
                retry_after_s=_RETRY_AFTER_S,
            )
        looked_up = found[1]
        # Tried again after one cache period, not on every request of the outage.
        self._known.put(key_hash, access, now + self.cache_ttl_s, looked_up)
        return access

    def invalidate(self) -> None:
        """Forget every cached lookup (after a key is revoked or its limits change)."""
        self._known.clear()
        self._unknown.clear()

    async def flush_last_used(self) -> None:
        """Write the last use of every key used since the previous round (one round of the
        background task; also before keys are read here, so this gateway's reads are exact)."""
        used, self._used = self._used, {}
        if not used:
            return
        try:
            await asyncio.to_thread(self._write_last_used, used)
        except BaseException:
            for key_id, at in used.items():  # kept for the next round (the newest wins)
                if len(self._used) < self._used_cap or key_id in self._used:
                    self._used[key_id] = max(at, self._used.get(key_id, 0.0))
            raise

    def _write_last_used(self, used: dict[str, float]) -> None:
        with self.db.session() as s:
            for key_id, at in sorted(used.items()):  # one order: no deadlock between gateways
                repo.touch_key(s, key_id, datetime.fromtimestamp(at, UTC))
