"""The database connection across a failover, on the local PostgreSQL: libpq's multi-host URLs
(the host that accepts writes is the one kept), and a read run again once when the connection
it had is broken under it, while a write is not. (The whole failover, a standby promoted under
load: `tests/platform/test_postgres_failover.py`.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError, ProgrammingError
from sqlalchemy.orm import Session

from modelyard.store.db import Database, postgres_engine_url
from tests.conftest import free_port
from tests.databases import fresh_postgres


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with fresh_postgres() as url:
        yield url.replace("postgresql+psycopg://", "postgresql://")


def test_libpq_host_lists_become_sqlalchemy_host_lists() -> None:
    url = postgres_engine_url(
        "postgresql://us%40er:p%3Ass@db1:5433,db2/app?target_session_attrs=read-write"
    )
    assert url.drivername == "postgresql+psycopg"
    assert (url.username, url.password, url.database) == ("us@er", "p:ss", "app")
    assert url.query == {"host": ("db1:5433", "db2"), "target_session_attrs": "read-write"}
    # One host: as it was, only the driver named.
    one = postgres_engine_url("postgres://u@db1:5433/app")
    assert (one.drivername, one.host, one.port, one.database) == ("postgresql+psycopg", "db1",
                                                                  5433, "app")  # fmt: skip


def test_a_multi_host_url_connects_to_the_host_that_answers(pg_url: str) -> None:
    # The first host refuses (nothing listens on a fresh free port); the second is the server.
    dead = free_port()
    host, rest = pg_url.removeprefix("postgresql://postgres@").split("/", 1)
    url = f"postgresql://postgres@127.0.0.1:{dead},{host}/{rest}?target_session_attrs=read-write"
    db = Database(url)
    try:
        db.migrate()
        with db.session() as s:
            port = s.execute(text("SELECT inet_server_port()")).scalar()
            writable = not s.execute(text("SELECT pg_is_in_recovery()")).scalar()
        assert (str(port), writable) == (host.rsplit(":", 1)[1], True)
    finally:
        db.dispose()


def _kill_own_connection(s: Session) -> None:
    """What a failover does to a connection in use: the server ends it mid-transaction."""
    s.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))


def test_a_read_runs_again_on_a_fresh_connection_after_its_connection_broke(pg_url: str) -> None:
    db = Database(pg_url)
    attempts: list[int] = []

    def read(s: Session) -> int:
        pid = int(s.execute(text("SELECT pg_backend_pid()")).scalar_one())
        attempts.append(pid)
        if len(attempts) == 1:
            _kill_own_connection(s)
        return pid

    try:
        pid = db.read(read)
        assert len(attempts) == 2 and pid == attempts[1] != attempts[0]
    finally:
        db.dispose()


def test_a_write_or_a_wrong_query_is_not_run_again(pg_url: str) -> None:
    db = Database(pg_url)
    runs = []
    try:
        with pytest.raises(OperationalError) as broken, db.session() as s:
            runs.append(1)
            _kill_own_connection(s)
        assert broken.value.connection_invalidated and runs == [1]

        def wrong(s: Session) -> None:
            runs.append(2)
            s.execute(text("SELECT no_such_column FROM pg_class"))

        with pytest.raises(ProgrammingError):
            db.read(wrong)
        assert runs == [1, 2]
    finally:
        db.dispose()
