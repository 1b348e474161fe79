"""Schema migrations on a database that holds data: from revision 0001 through every migration
one at a time to head, the rows written at each step survive, and the migrated schema matches
the models in `store/tables.py` exactly (no drift: the equivalent of `alembic check`)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text

from modelyard.store.db import MIGRATIONS, Database, make_engine, sqlite_url
from modelyard.store.schema import metadata as schema
from tests.databases import fresh_postgres

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.fixture(params=["postgresql", "sqlite"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "sqlite":
        e = make_engine(sqlite_url(tmp_path / "m.db"))
        yield e
        e.dispose()
        return
    with fresh_postgres() as url:
        e = make_engine(url)
        yield e
        e.dispose()


def config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def upgrade(engine: Engine, revision: str) -> None:
    cfg = config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def revisions() -> list[str]:
    """Every revision, oldest first (the history is linear)."""
    script = ScriptDirectory.from_config(config())
    assert len(script.get_heads()) == 1, "migration history has more than one head"
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def insert(engine: Engine, table: str, **row: Any) -> None:
    cols = ", ".join(f'"{c}"' for c in row)
    values = ", ".join(f":{c}" for c in row)
    with engine.begin() as conn:
        conn.execute(text(f'INSERT INTO "{table}" ({cols}) VALUES ({values})'), row)


def seed_0001(engine: Engine) -> None:
    insert(engine, "tenants", id="t-1", name="acme", monthly_token_quota=5000, is_system=False,
           created_at=NOW)  # fmt: skip
    insert(engine, "tenants", id="t-sys", name="system", monthly_token_quota=None, is_system=True,
           created_at=NOW)  # fmt: skip
    insert(engine, "api_keys", id="key-1", tenant_id="t-1", name="ci", key_hash="h" * 64,
           prefix="sk-my-abcd", scopes="admin,inference", rpm_limit=60, tpm_limit=None,
           created_at=NOW, revoked_at=None)  # fmt: skip
    insert(engine, "blobs", sha256="a" * 64, size=123, created_at=NOW)
    insert(engine, "tenant_blobs", tenant_id="t-1", sha256="a" * 64)
    insert(engine, "models", id="m-1", tenant_id="t-1", name="tiny", created_at=NOW)
    insert(engine, "model_versions", id="v-1", model_id="m-1", version=1, format="hf",
           manifest='{"config.json": {"sha256": "' + "a" * 64 + '", "size": 123}}',
           total_size=123, created_at=NOW)  # fmt: skip
    insert(engine, "endpoints", id="ep-1", tenant_id="t-1", model_name="tiny", public=False,
           artifact="tiny:1", version_id="v-1", framework="native", hardware='{"gpu_count": 1}',
           scaling='{"min_replicas": 1}', engine_options="{}", status="ready",
           status_message=None, created_at=NOW, deleted_at=None)  # fmt: skip
    for i in range(3):
        insert(engine, "usage_records", request_id=f"req-{i}", tenant_id="t-1", key_id="key-1",
               endpoint_id="ep-1", model="tiny", version_id="v-1", kind="chat.completions",
               prompt_tokens=10 + i, completion_tokens=5, cached_tokens=0, latency_ms=12.5,
               ttft_ms=3.0, status_code=200, status="ok", batch=i == 2,
               created_at=NOW + timedelta(seconds=i))  # fmt: skip


def seed_0002(engine: Engine) -> None:
    insert(engine, "blobs", sha256="b" * 64, size=77, created_at=NOW)
    insert(engine, "files", id="file-1", tenant_id="t-1", filename="in.jsonl", purpose="batch",
           bytes=77, sha256="b" * 64, created_at=NOW, deleted_at=None)  # fmt: skip
    insert(engine, "batches", id="batch-1", tenant_id="t-1", key_id="key-1",
           endpoint="/v1/chat/completions", input_file_id="file-1", completion_window="24h",
           status="in_progress", errors=None, output_file_id=None, error_file_id=None,
           metadata='{"job": "nightly"}', total=2, completed=1, failed=0, created_at=NOW,
           expires_at=NOW + timedelta(hours=24), in_progress_at=NOW)  # fmt: skip
    for line, status in ((1, "completed"), (2, "pending")):
        insert(engine, "batch_items", batch_id="batch-1", line=line, custom_id=f"c-{line}",
               valid=True, body='{"model": "tiny"}', status=status,
               status_code=200 if status == "completed" else None,
               request_id="req-2" if status == "completed" else None)  # fmt: skip


def drift(engine: Engine) -> list[Any]:
    """Differences between the database's schema and the models (what `alembic check` reports)."""
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn, opts={"compare_type": True, "render_as_batch": conn.dialect.name == "sqlite"}
        )
        return list(compare_metadata(ctx, schema))


SEEDS = {"0001": seed_0001, "0002": seed_0002}


def test_every_migration_keeps_the_data_and_head_matches_the_models(engine: Engine) -> None:
    steps = revisions()
    assert steps[0] == "0001" and len(steps) >= 5
    for revision in steps:
        upgrade(engine, revision)
        if revision in SEEDS:
            SEEDS[revision](engine)
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
        assert current == revision
        if revision == steps[-2]:
            # The drift check below sees a missing migration (so its silence means something).
            assert drift(engine), "one migration short of head, yet no drift was found"

    with engine.connect() as conn:
        tenant = conn.execute(text("SELECT * FROM tenants WHERE id = 't-1'")).mappings().one()
        assert tenant["name"] == "acme" and tenant["monthly_token_quota"] == 5000
        assert tenant["tier"] == "standard"  # 0005's default filled the existing row
        assert tenant["max_rpm"] is None and tenant["webhook_secret"] is None
        key = conn.execute(text("SELECT * FROM api_keys")).mappings().one()
        assert key["rpm_limit"] == 60 and key["scopes"] == "admin,inference"
        ep = conn.execute(text("SELECT * FROM endpoints")).mappings().one()
        assert ep["artifact"] == "tiny:1" and ep["version_id"] == "v-1"
        assert ep["good_version_id"] is None and ep["sampling_defaults"] is None
        usage = conn.execute(text("SELECT request_id, prompt_tokens FROM usage_records "
                                  "ORDER BY request_id")).all()  # fmt: skip
        assert [tuple(u) for u in usage] == [("req-0", 10), ("req-1", 11), ("req-2", 12)]
        items = conn.execute(text("SELECT custom_id, status FROM batch_items "
                                  "ORDER BY line")).all()  # fmt: skip
        assert [tuple(i) for i in items] == [("c-1", "completed"), ("c-2", "pending")]
        assert conn.execute(text("SELECT count(*) FROM files")).scalar() == 1
        assert conn.execute(text("SELECT count(*) FROM model_versions")).scalar() == 1

    # The ORM reads the migrated rows.
    db = Database(str(engine.url.render_as_string(hide_password=False)))
    try:
        from modelyard.store.tables import Batch, Tenant

        with db.session() as s:
            t = s.get(Tenant, "t-1")
            assert t is not None and t.tier == "standard"
            b = s.get(Batch, "batch-1")
            assert b is not None and b.metadata_ == {"job": "nightly"}
    finally:
        db.dispose()

    # No drift: what the migrations built is what the models declare.
    diff = drift(engine)
    assert diff == [], f"schema drift between store/tables.py and the migrations: {diff}"
    assert set(inspect(engine).get_table_names()) >= set(schema.tables)


def test_migrating_an_up_to_date_database_is_a_no_op(engine: Engine) -> None:
    upgrade(engine, "head")
    seed_0001(engine)
    upgrade(engine, "head")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM usage_records")).scalar() == 3
