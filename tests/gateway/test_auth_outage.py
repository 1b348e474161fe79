"""Key lookups while the database is unreachable (gateway/auth.py): a key looked up recently is
still served from its last good lookup (for at most `stale_ttl_s`), any other key gets a 503
`auth_unavailable` with Retry-After, never a 500; once the database answers again a key revoked
meanwhile is refused.

The outage is real: the authenticator's database is swapped for a PostgreSQL URL on a port
where nothing listens, so every lookup fails to connect as it would with the server down, or
on a socket that accepts connections and never answers (a hung server)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from modelyard.core.errors import DomainError
from modelyard.gateway.auth import Authenticator, generate_key
from modelyard.protocol.errors import APIError
from modelyard.store import repository as repo
from modelyard.store.db import Database
from tests.conftest import free_port


def add_key(db: Database) -> tuple[str, str]:
    with db.session() as s:
        tenant = repo.create_tenant(s, f"acme-{generate_key()[2]}", None)
        key, key_hash, prefix = generate_key()
        repo.add_key(s, tenant.id, "k", key_hash, prefix, ["inference"], None, None)
    return key, key_hash


async def refused(auth: Authenticator, key: str) -> APIError:
    """The refusal as the platform's edge answers it (a domain error shaped into HTTP)."""
    with pytest.raises(DomainError) as info:
        await auth.authenticate(f"Bearer {key}")
    return APIError.from_domain(info.value)


async def test_keys_during_a_database_outage(database: Database) -> None:
    known, known_hash = add_key(database)
    never_used, _ = add_key(database)
    auth = Authenticator(database, cache_ttl_s=0.05, stale_ttl_s=300.0)
    principal = await auth.authenticate(f"Bearer {known}")
    down = Database(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test")
    auth.db = down
    try:
        await asyncio.sleep(0.1)  # the cache entry has expired: the next use looks it up
        # A key seen before keeps working from its last good lookup.
        for _ in range(3):
            assert await auth.authenticate(f"Bearer {known}") == principal
            await asyncio.sleep(0.06)  # the cache's TTL (0.05 s) lapses: looked up again
        # A key with no good lookup (never used here, or not a key at all) cannot be checked:
        # a 503 that says when to retry, not a 500 and not served unchecked.
        for key in (never_used, "sk-my-not-a-key"):
            error = await refused(auth, key)
            assert (error.status, error.code) == (503, "auth_unavailable")
            assert error.headers["retry-after"].isdigit()
        # Staleness is bounded: past stale_ttl_s the last good lookup is not served either.
        auth.stale_ttl_s = 0.0
        await asyncio.sleep(0.06)  # the cache's TTL lapses (time itself, not a wait)
        assert (await refused(auth, known)).status == 503
        auth.stale_ttl_s = 300.0
    finally:
        down.dispose()
    # Revoked during the outage (by another gateway): refused once the database is back.
    with database.session() as s:
        row = repo.key_by_hash(s, known_hash)
        assert row is not None
        row.revoked_at = repo.now()
    auth.db = database
    await asyncio.sleep(0.06)  # the cache's TTL lapses (time itself, not a wait)
    assert (await refused(auth, known)).status == 401
    assert (await auth.authenticate(f"Bearer {never_used}")).tenant_id


async def test_a_hung_database_counts_as_down_after_the_lookup_timeout(database: Database) -> None:
    """A server that takes the connection and never answers must not hold requests for the
    driver's connect timeout (minutes): after `lookup_timeout_s` the key falls back as above."""
    known, _ = add_key(database)
    auth = Authenticator(database, cache_ttl_s=0.05, lookup_timeout_s=0.5)
    principal = await auth.authenticate(f"Bearer {known}")
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # the kernel completes the handshakes; nothing ever reads or answers
    down = Database(f"postgresql+psycopg://postgres@127.0.0.1:{hung.getsockname()[1]}/test")
    auth.db = down
    try:
        await asyncio.sleep(0.1)  # the cache's TTL lapses (time itself, not a wait)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await auth.authenticate(f"Bearer {known}") == principal
        assert (await refused(auth, "sk-my-no-such-key")).status == 503
        assert loop.time() - started < 30  # not the driver's connect timeout
    finally:
        hung.close()  # resets the waiting connections: the lookups' threads end
        down.dispose()
