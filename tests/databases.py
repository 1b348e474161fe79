"""Test databases and caches: a fresh SQLite file, a fresh PostgreSQL database on the local
server, a private Redis database number, and the two platform modes users run.

PostgreSQL and Redis run wherever they are reachable (CI has them on 127.0.0.1:5432 and :6379).
When one is not, the tests that need it skip and say why; when the environment variable `CI` is
set, an unreachable one is an error instead (a CI run must not pass by skipping them).

Using the platform modes (fixture `platform_env` in `tests/conftest.py`)::

    @pytest.fixture(scope="module")
    def platform(platform_env: dict[str, str], tmp_path_factory) -> Iterator[PlatformProcess]:
        p = PlatformProcess(tmp_path_factory.mktemp("data"), {**platform_env, ...}).start()
        ...

`platform_env` is module-scoped and parametrised with ids `sqlite-memory` (the default
`modelyard serve`: SQLite in the data dir, limits in memory) and `postgres-redis`
(`MODELYARD_DATABASE_URL` = a fresh PostgreSQL database, `MODELYARD_REDIS_URL` = a Redis database
number private to this test run, flushed when claimed). Every test that depends on it runs once per
mode. Outside fixtures, `platform_mode_env(mode)` is the same thing as a context manager.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import create_engine, text

POSTGRES_ADMIN_URL = os.environ.get(
    "MODELYARD_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
# Without a database number: each test run claims its own (see `fresh_redis`).
REDIS_BASE_URL = os.environ.get("MODELYARD_TEST_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")

PLATFORM_MODES = ("sqlite-memory", "postgres-redis")

# A Redis database number a run has claimed stays claimed this long unless released.
_CLAIM_KEY = "modelyard:test:claim"
_CLAIM_TTL_S = 3 * 3600


def services_required() -> bool:
    """In CI an unreachable PostgreSQL or Redis fails the run instead of skipping tests."""
    return bool(os.environ.get("CI"))


def skip_or_fail(reason: str) -> None:
    if services_required():
        pytest.fail(f"CI is set, so this is an error: {reason}", pytrace=False)
    print(f"skipping: {reason}")
    pytest.skip(reason)


def postgres_unreachable() -> str | None:
    try:
        engine = create_engine(POSTGRES_ADMIN_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("select 1"))
        engine.dispose()
    except Exception as exc:
        return f"PostgreSQL is not reachable at {POSTGRES_ADMIN_URL}: {exc}".splitlines()[0]
    return None


def redis_unreachable() -> str | None:
    import redis

    try:
        client = redis.Redis.from_url(REDIS_BASE_URL, socket_connect_timeout=3, socket_timeout=3)
        client.ping()
        client.close()
    except Exception as exc:
        return f"Redis is not reachable at {REDIS_BASE_URL}: {exc}".splitlines()[0]
    return None


@contextmanager
def fresh_postgres() -> Iterator[str]:
    """A new, empty database for one test module; dropped afterwards."""
    reason = postgres_unreachable()
    if reason:
        skip_or_fail(reason)
    name = f"modelyard_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        drop_postgres(name)
        admin.dispose()


def drop_postgres(name: str) -> None:
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = :n AND pid <> pg_backend_pid()"
            ),
            {"n": name},
        )
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


@contextmanager
def fresh_redis() -> Iterator[str]:
    """A Redis database number no other test run is using, flushed, as a URL; released after.

    Several test runs may share the machine's Redis, so a run claims a database number (1-15;
    0 is left to whoever uses Redis by default) with a SET NX marker before flushing it.
    """
    import redis

    reason = redis_unreachable()
    if reason:
        skip_or_fail(reason)
    token = uuid.uuid4().hex
    numbers = list(range(1, 16))
    random.shuffle(numbers)
    for db in numbers:
        client = redis.Redis.from_url(f"{REDIS_BASE_URL}/{db}", socket_timeout=5)
        if client.set(_CLAIM_KEY, token, nx=True, ex=_CLAIM_TTL_S):
            client.flushdb()
            client.set(_CLAIM_KEY, token, ex=_CLAIM_TTL_S)
            try:
                yield f"{REDIS_BASE_URL}/{db}"
            finally:
                if client.get(_CLAIM_KEY) == token.encode():
                    client.flushdb()
                client.close()
            return
        client.close()
    skip_or_fail(f"every Redis database number 1-15 at {REDIS_BASE_URL} is claimed by a test run")


@contextmanager
def platform_mode_env(mode: str) -> Iterator[dict[str, str]]:
    """The environment for `PlatformProcess` in one of `PLATFORM_MODES`."""
    if mode == "sqlite-memory":
        yield {}
        return
    if mode != "postgres-redis":
        raise ValueError(f"unknown platform mode {mode!r}")
    with fresh_postgres() as database_url, fresh_redis() as redis_url:
        yield {"MODELYARD_DATABASE_URL": database_url, "MODELYARD_REDIS_URL": redis_url}
