"""Queries and writes on the tables, one function per question the platform asks.

Everything takes an open `Session`; callers own the transaction (`Database.session()`).
Tenant scoping is explicit in every signature that reads tenant data.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from modelyard.store.tables import (
    ApiKey,
    Blob,
    Endpoint,
    EndpointVersion,
    Model,
    ModelVersion,
    Tenant,
    TenantBlob,
    UsageRecord,
)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


def now() -> datetime:
    return datetime.now(UTC)


def as_utc(ts: datetime) -> datetime:
    """SQLite hands datetimes back without their zone; they were written as UTC."""
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


# ----- tenants --------------------------------------------------------------------------------


def create_tenant(
    s: Session,
    name: str,
    monthly_token_quota: int | None,
    is_system: bool = False,
    tier: str = "standard",
    **ceilings: int | None,
) -> Tenant:
    """A new tenant; `ceilings` are `Tenant` columns such as max_rpm or max_endpoints."""
    tenant = Tenant(
        id=new_id("tn"),
        name=name,
        monthly_token_quota=monthly_token_quota,
        is_system=is_system,
        created_at=now(),
        tier=tier,
        **ceilings,
    )
    s.add(tenant)
    s.flush()
    return tenant


def get_tenant(s: Session, tenant_id: str) -> Tenant | None:
    return s.get(Tenant, tenant_id)


def list_tenants(s: Session) -> Sequence[Tenant]:
    return s.scalars(select(Tenant).order_by(Tenant.created_at)).all()


def system_tenant(s: Session) -> Tenant | None:
    return s.scalar(select(Tenant).where(Tenant.is_system.is_(True)))


# ----- keys -----------------------------------------------------------------------------------


def add_key(
    s: Session,
    tenant_id: str,
    name: str,
    key_hash: str,
    prefix: str,
    scopes: list[str],
    rpm_limit: int | None,
    tpm_limit: int | None,
    *,
    expires_at: datetime | None = None,
    allowed_models: list[str] | None = None,
) -> ApiKey:
    key = ApiKey(
        id=new_id("key"),
        tenant_id=tenant_id,
        name=name,
        key_hash=key_hash,
        prefix=prefix,
        scopes=",".join(sorted(set(scopes))),
        rpm_limit=rpm_limit,
        tpm_limit=tpm_limit,
        created_at=now(),
        revoked_at=None,
        expires_at=expires_at,
        allowed_models=allowed_models,
    )
    s.add(key)
    s.flush()
    return key


def key_by_hash(s: Session, key_hash: str) -> ApiKey | None:
    """The key whose secret, or whose secret before its last rotation, hashes to `key_hash`."""
    found = s.scalar(select(ApiKey).where(ApiKey.key_hash == key_hash))
    if found is None:
        found = s.scalar(select(ApiKey).where(ApiKey.previous_key_hash == key_hash).limit(1))
    return found


def touch_key(s: Session, key_id: str, at: datetime) -> None:
    """Record that the key was used at `at` (never moving its last use back)."""
    s.execute(
        update(ApiKey)
        .where(ApiKey.id == key_id)
        .where(or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < at))
        .values(last_used_at=at)
    )


def get_key(s: Session, tenant_id: str | None, key_id: str) -> ApiKey | None:
    key = s.get(ApiKey, key_id)
    if key is None or (tenant_id is not None and key.tenant_id != tenant_id):
        return None
    return key


def list_keys(s: Session, tenant_id: str | None) -> Sequence[ApiKey]:
    q = select(ApiKey).order_by(ApiKey.created_at)
    if tenant_id is not None:
        q = q.where(ApiKey.tenant_id == tenant_id)
    return s.scalars(q).all()


# ----- registry -------------------------------------------------------------------------------


def add_blob(s: Session, tenant_id: str, sha256: str, size: int) -> None:
    """Record a blob and that `tenant_id` uploaded it."""
    if s.get(Blob, sha256) is None:
        s.add(Blob(sha256=sha256, size=size, created_at=now()))
        s.flush()
    if s.get(TenantBlob, (tenant_id, sha256)) is None:
        s.add(TenantBlob(tenant_id=tenant_id, sha256=sha256))
        s.flush()


def owns_blob(s: Session, tenant_id: str, sha256: str) -> bool:
    return s.get(TenantBlob, (tenant_id, sha256)) is not None


def get_model(s: Session, tenant_id: str, name: str) -> Model | None:
    return s.scalar(select(Model).where(Model.tenant_id == tenant_id, Model.name == name))


def create_model(s: Session, tenant_id: str, name: str) -> Model:
    model = Model(id=new_id("mdl"), tenant_id=tenant_id, name=name, created_at=now())
    s.add(model)
    s.flush()
    return model


def list_models(s: Session, tenant_id: str) -> Sequence[Model]:
    return s.scalars(
        select(Model).where(Model.tenant_id == tenant_id).order_by(Model.created_at)
    ).all()


def list_versions(s: Session, model_id: str) -> Sequence[ModelVersion]:
    return s.scalars(
        select(ModelVersion).where(ModelVersion.model_id == model_id).order_by(ModelVersion.version)
    ).all()


def get_version(s: Session, model_id: str, version: int | None) -> ModelVersion | None:
    q = select(ModelVersion).where(ModelVersion.model_id == model_id)
    if version is None:
        q = q.order_by(ModelVersion.version.desc()).limit(1)
    else:
        q = q.where(ModelVersion.version == version)
    return s.scalar(q)


def version_by_id(s: Session, version_id: str) -> ModelVersion | None:
    return s.get(ModelVersion, version_id)


def add_version(
    s: Session,
    model_id: str,
    fmt: str,
    manifest: dict[str, Any],
    total_size: int,
    param_count: int | None = None,
) -> ModelVersion:
    last = s.scalar(select(func.max(ModelVersion.version)).where(ModelVersion.model_id == model_id))
    version = ModelVersion(
        id=new_id("mv"),
        model_id=model_id,
        version=(last or 0) + 1,
        format=fmt,
        manifest=manifest,
        total_size=total_size,
        param_count=param_count,
        created_at=now(),
    )
    s.add(version)
    s.flush()
    return version


# ----- endpoints ------------------------------------------------------------------------------


def live_endpoints(s: Session, tenant_id: str | None = None) -> Sequence[Endpoint]:
    q = select(Endpoint).where(Endpoint.deleted_at.is_(None)).order_by(Endpoint.created_at)
    if tenant_id is not None:
        q = q.where(Endpoint.tenant_id == tenant_id)
    return s.scalars(q).all()


def endpoint_versions(s: Session, endpoint_id: str) -> Sequence[EndpointVersion]:
    """The endpoint's versions beside its stable one that still matter (not retired)."""
    q = (
        select(EndpointVersion)
        .where(EndpointVersion.endpoint_id == endpoint_id, EndpointVersion.state != "retired")
        .order_by(EndpointVersion.created_at)
    )
    return s.scalars(q).all()


def deployed_capacity(s: Session, tenant_id: str) -> tuple[int, int]:
    """A tenant's live endpoints and the replicas they may scale to (hardware.max_replicas)."""
    endpoints = live_endpoints(s, tenant_id)
    replicas = sum(int((ep.hardware or {}).get("max_replicas", 1)) for ep in endpoints)
    return len(endpoints), replicas


def live_endpoint_by_name(s: Session, tenant_id: str, model_name: str) -> Endpoint | None:
    return s.scalar(
        select(Endpoint).where(
            Endpoint.tenant_id == tenant_id,
            Endpoint.model_name == model_name,
            Endpoint.deleted_at.is_(None),
        )
    )


def endpoints_using_model(s: Session, tenant_id: str, model_id: str) -> Sequence[Endpoint]:
    """Live endpoints that serve, keep or fall back to a version of the model: as their
    version, their last good version, or a canary or warm previous version beside it."""
    version_ids = select(ModelVersion.id).where(ModelVersion.model_id == model_id)
    beside = select(EndpointVersion.endpoint_id).where(
        EndpointVersion.version_id.in_(version_ids), EndpointVersion.state == "serving"
    )
    return s.scalars(
        select(Endpoint).where(
            Endpoint.tenant_id == tenant_id,
            Endpoint.deleted_at.is_(None),
            Endpoint.version_id.in_(version_ids)
            | Endpoint.good_version_id.in_(version_ids)
            | Endpoint.id.in_(beside),
        )
    ).all()


def release_deleted_endpoints(s: Session, model_id: str) -> int:
    """Deleted endpoints stop pointing at the model's versions (their `artifact` text keeps
    the reference), so the versions can go; returns how many rows changed."""
    version_ids = select(ModelVersion.id).where(ModelVersion.model_id == model_id)
    rows = s.scalars(
        select(Endpoint).where(
            Endpoint.deleted_at.is_not(None),
            Endpoint.version_id.in_(version_ids),
        )
    ).all()
    for row in rows:
        row.version_id = None
    s.flush()
    return len(rows)


# ----- usage ----------------------------------------------------------------------------------


def insert_usage(s: Session, rows: list[dict[str, Any]]) -> int:
    """Insert usage rows, skipping request ids already recorded; returns how many were new."""
    if not rows:
        return 0
    # Rows journaled before a column existed get it empty (one statement needs one shape).
    rows = [{"cost_micro": None, "team_id": None, **r} for r in rows]
    dialect = s.get_bind().dialect.name
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    # One statement, the rows as parameters: compiled once and cached, not per batch.
    stmt = (
        insert(UsageRecord.__table__)  # type: ignore[arg-type]  # a Table at run time
        .on_conflict_do_nothing(index_elements=["request_id"])
        .returning(UsageRecord.__table__.c.request_id)
    )
    rows = [{"adapter": None, **r} for r in rows]  # a row journaled before the column
    return len(s.connection().execute(stmt, rows).all())


def usage_rows(
    s: Session, tenant_id: str | None, start: datetime, end: datetime
) -> Sequence[UsageRecord]:
    q = select(UsageRecord).where(UsageRecord.created_at >= start, UsageRecord.created_at < end)
    if tenant_id is not None:
        q = q.where(UsageRecord.tenant_id == tenant_id)
    return s.scalars(q.order_by(UsageRecord.created_at, UsageRecord.id)).all()


def tokens_used_since(s: Session, since: datetime) -> dict[str, int]:
    """Prompt + completion tokens per tenant since `since` (to seed quota counters)."""
    total = func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens)
    rows = s.execute(
        select(UsageRecord.tenant_id, total)
        .where(UsageRecord.created_at >= since)
        .group_by(UsageRecord.tenant_id)
    ).all()
    return {tenant: int(n or 0) for tenant, n in rows}
