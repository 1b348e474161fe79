"""Database connection (SQLite by default, PostgreSQL by URL) and schema migrations at start.

PostgreSQL URLs take libpq's multi-host form, `postgresql://user@h1:5432,h2:5432/db?
target_session_attrs=read-write`: each new connection tries the hosts in turn and keeps the one
that accepts writes, so after a standby is promoted new connections find it. Connections the
failover broke are dropped (`pool_pre_ping`, and SQLAlchemy discards the pool when one in use
turns out disconnected); `Database.read` runs a read again once on a fresh connection when the
one it had was broken. Writes are not run again here: one whose commit went unanswered may have
committed (a caller whose write is idempotent by key, as the usage writer's, retries it itself).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import parse_qsl, unquote, urlsplit

from sqlalchemy import CursorResult, Engine, Result, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"
T = TypeVar("T")

# Every PostgreSQL connection is bounded: a connect gives up on a host after 3 s (then tries
# the next), and a connection whose server vanished without a word (its machine died) is found
# dead by TCP keepalives and the kernel's user timeout within about 15 s, not the minutes of a
# TCP retransmission timeout. The same libpq parameters in the URL win over these.
PG_CONNECT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 3,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 15_000,
}


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            # WAL lets readers run while the metering writer commits.
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    engine_url = postgres_engine_url(url)
    # A bounded connect: a database that drops connections silently must not hold threads.
    return create_engine(
        engine_url,
        pool_size=10,
        max_overflow=20,
        pool_pre_ping=True,
        connect_args={k: v for k, v in PG_CONNECT_DEFAULTS.items() if k not in engine_url.query},
    )


def postgres_engine_url(url: str) -> URL:
    """SQLAlchemy's URL for a PostgreSQL URL in libpq's syntax (`postgresql://` or
    `postgres://`, one host or several) or SQLAlchemy's own (`postgresql+psycopg://`). libpq's
    `h1:p1,h2:p2` host list, which SQLAlchemy cannot parse, becomes its `?host=h1:p1&host=h2:p2`
    form of the same list; everything else in the query (`target_session_attrs`, ...) is kept."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix) :]
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        return make_url(url)
    user, _, password = userinfo.partition(":")
    query: dict[str, list[str]] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        query.setdefault(name, []).append(value)
    return URL.create(
        parts.scheme,
        username=unquote(user) or None,
        password=unquote(password) or None,
        database=unquote(parts.path.lstrip("/")) or None,
        query={
            **{name: values[0] if len(values) == 1 else tuple(values)
               for name, values in query.items()},
            "host": tuple(h for h in hosts.split(",") if h),
        },
    )  # fmt: skip


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest Alembic revision."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            # Several processes (gateways, controllers) may start at once on one database:
            # one migrates, the others wait for it and then find the schema current.
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7164503761)")
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


class Database:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def migrate(self) -> None:
        migrate(self.engine)

    def secure_file(self) -> None:
        """Make a SQLite database (and its WAL and shared-memory files) owner-only, 0600: it
        holds key hashes, usage and every tenant's data. SQLite creates the WAL files with the
        database file's mode, so fixing the file at start covers later ones too."""
        path = self.engine.url.database
        if self.dialect != "sqlite" or not path or path == ":memory:":
            return
        for name in (path, f"{path}-wal", f"{path}-shm"):
            with suppress(FileNotFoundError):
                os.chmod(name, 0o600)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session whose transaction commits on success and rolls back on error."""
        with self._sessions() as session, session.begin():
            yield session

    def read(self, work: Callable[[Session], T]) -> T:
        """`work(session)` in a transaction, run once more on a fresh connection if the
        connection it had turned out broken (the database failed over or restarted under it).
        Only for work that writes nothing: running it twice must be harmless."""
        try:
            with self.session() as s:
                return work(s)
        except DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            log.info("database connection broken (%s); reading again", str(exc).split("\n")[0])
        with self.session() as s:
            return work(s)

    def dispose(self) -> None:
        self.engine.dispose()


def rows_changed(result: Result[Any]) -> int:
    """How many rows an UPDATE or DELETE changed (`Session.execute` is typed as a plain
    `Result`; for those statements it is a `CursorResult`)."""
    return int(cast("CursorResult[Any]", result).rowcount)
