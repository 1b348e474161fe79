"""Key changes across gateways (gateway/auth.py with control/tenancy.py), on SQLite and on
PostgreSQL: two authenticators on one database stand for two gateway processes. A change made
through one (re-scoped, rotated with no grace, expired) applies there at once and in the other
once its cached lookup ends (`auth_cache_ttl_s`); an expiry that arrives needs no lookup at
all, even under a cache that would hold the key for an hour; each gateway's last uses reach
the database when it flushes, never moving a key's last use back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from modelyard.control.audit import AuditLog
from modelyard.control.tenancy import Tenancy
from modelyard.core.errors import DomainError
from modelyard.core.identity import Principal
from modelyard.gateway.auth import Authenticator, generate_key
from modelyard.protocol.management import KeyCreate, KeyRotate, KeyUpdate
from modelyard.store import repository as repo
from modelyard.store.db import Database, sqlite_url
from tests.databases import fresh_postgres

TTL_S = 0.3


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        db = Database(sqlite_url(tmp_path / "keys.db"))
        db.migrate()
        yield db
        db.dispose()
        return
    with fresh_postgres() as url:
        db = Database(url)
        db.migrate()
        yield db
        db.dispose()


async def code_of(auth: Authenticator, key: str) -> str | None:
    """None: the key authenticates; else the refusal's code."""
    try:
        await auth.authenticate(f"Bearer {key}")
    except DomainError as exc:
        return exc.code
    return None


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Polls `check` (every 50 ms, for 30 s at most)."""
    for _ in range(600):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_change_in_one_gateway_reaches_the_other(database: Database) -> None:
    a, b = Authenticator(database, cache_ttl_s=TTL_S), Authenticator(database, cache_ttl_s=TTL_S)
    tenancy = Tenancy(database, AuditLog(database), a.invalidate, generate_key)  # a's control
    with database.session() as s:
        tenant = repo.create_tenant(s, "acme", None)
        admin_key, key_hash, prefix = generate_key()
        repo.add_key(s, tenant.id, "admin", key_hash, prefix, ["admin"], None, None)
    admin: Principal = await a.authenticate(f"Bearer {admin_key}")
    key = await tenancy.create_key(admin, KeyCreate(name="app"))
    secret = key["key"]
    for gateway in (a, b):  # a lookup cached in each
        assert (await gateway.authenticate(f"Bearer {secret}")).allows_model("other")

    # Re-scoped through a: a at once, b once its cached lookup ends.
    await tenancy.update_key(admin, key["id"], KeyUpdate(allowed_models=["tiny"]))
    assert not (await a.authenticate(f"Bearer {secret}")).allows_model("other")

    async def b_rescoped() -> bool:
        return not (await b.authenticate(f"Bearer {secret}")).allows_model("other")

    await until(b_rescoped, "the other gateway to see the new allowed models")

    # Rotated with no grace: the old secret is refused by a at once, by b within its TTL.
    rotated = await tenancy.rotate_key(admin, key["id"], KeyRotate(grace_period_seconds=0))
    assert await code_of(a, secret) == "key_expired"

    async def b_refuses_old() -> bool:
        return await code_of(b, secret) == "key_expired"

    await until(b_refuses_old, "the other gateway to refuse the replaced secret")
    new = rotated["key"]
    assert await code_of(a, new) is None and await code_of(b, new) is None

    # An expiry that arrives needs no lookup: a gateway caching keys for an hour refuses too.
    hour = Authenticator(database, cache_ttl_s=3600)
    soon = datetime.now(UTC) + timedelta(seconds=5)
    await tenancy.update_key(admin, key["id"], KeyUpdate(expires_at=soon))
    assert await code_of(hour, new) is None

    async def hour_refuses() -> bool:
        return await code_of(hour, new) == "key_expired"

    await until(hour_refuses, "the cached key to expire")

    # Last use: each gateway writes its own; the newest stays.
    await b.flush_last_used()
    with database.session() as s:
        row = repo.get_key(s, None, key["id"])
        assert row is not None and row.last_used_at is not None
        by_b = repo.as_utc(row.last_used_at)
    await a.flush_last_used()  # a's last use of this key was before b's last one
    with database.session() as s:
        row = repo.get_key(s, None, key["id"])
        assert row is not None and row.last_used_at is not None
        assert repo.as_utc(row.last_used_at) == by_b
