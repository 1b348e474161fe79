"""The store on SQLite and on PostgreSQL: migrations, tenants and keys, registry rows, endpoint
names, and usage written exactly once per request id."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import inspect
from sqlalchemy.exc import IntegrityError

from modelyard.store import repository as repo
from modelyard.store.db import Database, sqlite_url
from modelyard.store.tables import Endpoint
from tests.databases import fresh_postgres


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        database = Database(sqlite_url(tmp_path / "test.db"))
        database.migrate()
        yield database
        database.dispose()
        return
    with fresh_postgres() as url:
        database = Database(url)
        database.migrate()
        yield database
        database.dispose()


def usage_row(request_id: str, tenant_id: str, **kw: object) -> dict:
    row = dict(
        request_id=request_id,
        tenant_id=tenant_id,
        key_id="key-1",
        endpoint_id="ep-1",
        model="m",
        version_id=None,
        kind="chat.completions",
        prompt_tokens=10,
        completion_tokens=5,
        cached_tokens=0,
        latency_ms=12.5,
        ttft_ms=3.0,
        status_code=200,
        status="ok",
        batch=False,
        created_at=repo.now(),
    )
    row.update(kw)
    return row


def test_migrations_create_every_table_and_are_idempotent(db: Database) -> None:
    tables = set(inspect(db.engine).get_table_names())
    assert {"tenants", "api_keys", "blobs", "tenant_blobs", "models", "model_versions",
            "endpoints", "usage_records", "alembic_version"} <= tables  # fmt: skip
    db.migrate()  # a second start changes nothing


def test_tenants_and_keys(db: Database) -> None:
    with db.session() as s:
        t = repo.create_tenant(s, "acme", 1000)
        k = repo.add_key(s, t.id, "ci", "h" * 64, "sk-my-abcd", ["inference"], 60, 1000)
    with db.session() as s:
        assert repo.key_by_hash(s, "h" * 64).id == k.id
        assert repo.get_key(s, "other-tenant", k.id) is None  # scoped lookups never cross
        assert [x.id for x in repo.list_keys(s, t.id)] == [k.id]
    with pytest.raises(IntegrityError), db.session() as s:
        repo.create_tenant(s, "acme", None)


def test_usage_is_written_once_per_request_id(db: Database) -> None:
    with db.session() as s:
        assert repo.insert_usage(s, [usage_row("r1", "t1"), usage_row("r2", "t1")]) == 2
    with db.session() as s:
        # A retry of r2 and a new r3 in one batch: only r3 is new.
        assert repo.insert_usage(s, [usage_row("r2", "t1", completion_tokens=99),
                                     usage_row("r3", "t2")]) == 1  # fmt: skip
    start, end = repo.now() - timedelta(hours=1), repo.now() + timedelta(hours=1)
    with db.session() as s:
        rows = repo.usage_rows(s, "t1", start, end)
        assert sorted(r.request_id for r in rows) == ["r1", "r2"]
        assert {r.completion_tokens for r in rows} == {5}  # the first write stands
        assert repo.tokens_used_since(s, start) == {"t1": 30, "t2": 15}


def test_registry_rows_and_blob_ownership(db: Database) -> None:
    sha = "a" * 64
    with db.session() as s:
        t1 = repo.create_tenant(s, "one", None)
        t2 = repo.create_tenant(s, "two", None)
        repo.add_blob(s, t1.id, sha, 10)
        repo.add_blob(s, t1.id, sha, 10)  # idempotent
        m = repo.create_model(s, t1.id, "llama")
        v1 = repo.add_version(s, m.id, "hf", {"files": {"config.json": {"sha256": sha}}}, 10)
        v2 = repo.add_version(s, m.id, "hf", {"files": {"config.json": {"sha256": sha}}}, 10)
    with db.session() as s:
        assert repo.owns_blob(s, t1.id, sha) and not repo.owns_blob(s, t2.id, sha)
        assert (v1.version, v2.version) == (1, 2)
        assert repo.get_version(s, m.id, None).id == v2.id
        assert repo.get_version(s, m.id, 1).id == v1.id
        assert repo.get_model(s, t2.id, "llama") is None


def test_one_live_endpoint_per_tenant_and_name(db: Database) -> None:
    def endpoint(tenant_id: str, name: str) -> Endpoint:
        return Endpoint(
            id=repo.new_id("ep"), tenant_id=tenant_id, model_name=name, public=False,
            artifact="x", version_id=None, framework="native", hardware={}, scaling={},
            engine_options={}, status="ready", status_message=None, created_at=repo.now(),
            deleted_at=None,
        )  # fmt: skip

    with db.session() as s:
        t = repo.create_tenant(s, "t", None)
        first = endpoint(t.id, "chat")
        s.add(first)
    with pytest.raises(IntegrityError), db.session() as s:
        s.add(endpoint(t.id, "chat"))
    with db.session() as s:
        s.get(Endpoint, first.id).deleted_at = repo.now()
    with db.session() as s:
        s.add(endpoint(t.id, "chat"))  # the name is free again once the first is deleted
        assert len(repo.live_endpoints(s, t.id)) == 1
