"""Test databases: a fresh SQLite file, or a fresh PostgreSQL database on the local server.

PostgreSQL runs wherever it is reachable (CI has it on 127.0.0.1:5432); when it is not, the
tests that need it skip and say why.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import create_engine, text

POSTGRES_ADMIN_URL = os.environ.get(
    "MODELYARD_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def postgres_unreachable() -> str | None:
    try:
        engine = create_engine(POSTGRES_ADMIN_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("select 1"))
        engine.dispose()
    except Exception as exc:
        return f"PostgreSQL is not reachable at {POSTGRES_ADMIN_URL}: {exc}".splitlines()[0]
    return None


@contextmanager
def fresh_postgres() -> Iterator[str]:
    """A new, empty database for one test module; dropped afterwards."""
    reason = postgres_unreachable()
    if reason:
        pytest.skip(reason)
    name = f"modelyard_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
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
