"""Alembic environment: runs on the connection `Database.migrate` hands over."""

from alembic import context
from sqlalchemy import create_engine

from modelyard.store.schema import metadata

config = context.config
connection = config.attributes.get("connection")


def _run(conn) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=conn,
        target_metadata=metadata,
        render_as_batch=conn.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    _run(connection)
else:  # `alembic` command line: MODELYARD_DATABASE_URL or sqlalchemy.url
    url = config.get_main_option("sqlalchemy.url")
    if url is None:
        raise SystemExit("alembic: set MODELYARD_DATABASE_URL or sqlalchemy.url")
    with create_engine(url).connect() as conn:
        _run(conn)
