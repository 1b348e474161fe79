"""The database schema (SQLAlchemy 2 declarative). Migrations in `migrations/` must match it."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        datetime: DateTime(timezone=True),
    }


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    monthly_token_quota: Mapped[int | None] = mapped_column(BigInteger)
    is_system: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]
    # Service tier (free | standard | priority), set by the platform admin: orders the admission
    # queue and the engine's priority under overload.
    tier: Mapped[str] = mapped_column(String(20), default="standard", server_default="standard")
    # Ceilings set by the platform admin; the tenant's own admins may only tighten within them.
    # None: no ceiling.
    max_rpm: Mapped[int | None] = mapped_column(Integer)
    max_tpm: Mapped[int | None] = mapped_column(Integer)
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer)
    max_concurrent_batch_items: Mapped[int | None] = mapped_column(Integer)
    max_endpoints: Mapped[int | None] = mapped_column(Integer)
    max_replicas: Mapped[int | None] = mapped_column(Integer)
    # Bytes of blobs (models, files) it may hold; None: the platform's tenant_storage_bytes.
    max_storage_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # The tenant's own webhook signing secret (Standard Webhooks `whsec_…`), made on first use.
    webhook_secret: Mapped[str | None] = mapped_column(String(100))


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(20))
    scopes: Mapped[str] = mapped_column(String(100))  # comma-separated: inference,admin
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    # After this the key is refused (401 key_expired); None: it does not expire.
    expires_at: Mapped[datetime | None]
    # Model name patterns (`*` a wildcard) the key may call; None: every model it can see.
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON)
    # When the key was last used, written by the gateways at most once a minute per key.
    last_used_at: Mapped[datetime | None]
    # The secret a rotation replaced, still accepted until `previous_key_expires_at`.
    previous_key_hash: Mapped[str | None] = mapped_column(String(64), index=True)
    previous_key_expires_at: Mapped[datetime | None]
    # Whose key it is: a user's (cut to the user's role) or a team's; both None: the tenant's.
    owner_user_id: Mapped[str | None] = mapped_column(ForeignKey("users.id"), index=True)
    owner_team_id: Mapped[str | None] = mapped_column(ForeignKey("teams.id"), index=True)


class Blob(Base):
    """One content-addressed file in the artifact store."""

    __tablename__ = "blobs"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime]


class TenantBlob(Base):
    """A tenant proved it has a blob's content (it uploaded it); only then may it use the blob.

    Blobs are stored once, whoever uploads them; ownership keeps one tenant from learning that
    another holds some content, or from referencing it.
    """

    __tablename__ = "tenant_blobs"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"), primary_key=True)


class Model(Base):
    __tablename__ = "models"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime]


class ModelVersion(Base):
    """An immutable version: a manifest of files (relative path → sha256 and size)."""

    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("model_id", "version"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    format: Mapped[str] = mapped_column(String(20))  # hf | gguf
    manifest: Mapped[dict[str, Any]]
    total_size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime]
    # What sizing multiplies by the dtype width, recorded at push (`core/model_files.py`);
    # NULL for versions pushed before it was recorded, filled in once when first needed.
    param_count: Mapped[int | None] = mapped_column(BigInteger)


class Endpoint(Base):
    __tablename__ = "endpoints"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    model_name: Mapped[str] = mapped_column(String(200))
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    artifact: Mapped[str] = mapped_column(String(1000))  # as given: registry ref or local path
    version_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id"))
    # The last version that served: where a failing rollout falls back to.
    good_version_id: Mapped[str | None] = mapped_column(String(40))
    framework: Mapped[str] = mapped_column(String(40))
    hardware: Mapped[dict[str, Any]]
    scaling: Mapped[dict[str, Any]]
    engine_options: Mapped[dict[str, Any]]
    sampling_defaults: Mapped[dict[str, Any] | None]
    # The last rollback of a canary or a promotion: why, the numbers, who, when.
    last_rollback: Mapped[dict[str, Any] | None]
    status: Mapped[str] = mapped_column(String(40))
    status_message: Mapped[str | None] = mapped_column(String(2000))
    created_at: Mapped[datetime]
    deleted_at: Mapped[datetime | None]


Index(
    "uq_endpoints_live_name",
    Endpoint.tenant_id,
    Endpoint.model_name,
    unique=True,
    sqlite_where=Endpoint.deleted_at.is_(None),
    postgresql_where=Endpoint.deleted_at.is_(None),
)


class EndpointVersion(Base):
    """One version of an endpoint beside its stable one (`control/versions.py`): a canary with
    its share of traffic, the stable version while a canary runs, or the previous stable one
    kept warm after a promotion (until `warm_until`) so that a rollback loads nothing."""

    __tablename__ = "endpoint_versions"

    endpoint_id: Mapped[str] = mapped_column(ForeignKey("endpoints.id"), primary_key=True)
    version_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    artifact: Mapped[str] = mapped_column(String(1000))  # NAME:VERSION
    role: Mapped[str] = mapped_column(String(20))  # stable | canary | previous
    weight: Mapped[int] = mapped_column(Integer)  # percent of the endpoint's requests
    replicas: Mapped[int] = mapped_column(Integer)
    engine_options: Mapped[dict[str, Any]]  # over the endpoint's
    slo: Mapped[dict[str, Any]]  # thresholds and progressive steps
    state: Mapped[str] = mapped_column(String(20))  # serving | rolled_back | retired
    warm_until: Mapped[datetime | None]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class UsageRecord(Base):
    """What one request consumed; exactly one row per request id."""

    __tablename__ = "usage_records"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(80), unique=True)
    tenant_id: Mapped[str] = mapped_column(String(40), index=True)
    key_id: Mapped[str] = mapped_column(String(40))
    endpoint_id: Mapped[str | None] = mapped_column(String(40))
    model: Mapped[str] = mapped_column(String(200))
    version_id: Mapped[str | None] = mapped_column(String(40))
    kind: Mapped[str] = mapped_column(String(40))  # chat.completions | completions | …
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    latency_ms: Mapped[float]
    ttft_ms: Mapped[float | None]
    status_code: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(40))  # ok | client_disconnected | error
    batch: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(index=True)
    # Micro-dollars at the price when it ran (`core/pricing.py`); NULL for rows before prices.
    cost_micro: Mapped[int | None] = mapped_column(BigInteger)
    team_id: Mapped[str | None] = mapped_column(String(40))  # the key's team, if any
    # The tenant's registry LoRA adapter it called, `name:version`, served by the base endpoint
    # `endpoint_id` (whose model is `model`); NULL for the base model itself.
    adapter: Mapped[str | None] = mapped_column(String(200))


Index("ix_usage_tenant_time", UsageRecord.tenant_id, UsageRecord.created_at)


class File(Base):
    """An uploaded or generated file (OpenAI Files API); the bytes live in the artifact store."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    filename: Mapped[str] = mapped_column(String(500))
    purpose: Mapped[str] = mapped_column(String(40))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"))
    created_at: Mapped[datetime]
    deleted_at: Mapped[datetime | None]


class Batch(Base):
    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    key_id: Mapped[str] = mapped_column(String(40))
    endpoint: Mapped[str] = mapped_column(String(100))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(20))
    status: Mapped[str] = mapped_column(String(20), index=True)
    errors: Mapped[dict[str, Any] | None]
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata")
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]
    webhook_delivered_at: Mapped[datetime | None]


class BatchItem(Base):
    """One line of a batch; its result is written once, when it finishes.

    Valid lines are unique per (batch, custom_id); an invalid line (a duplicate custom_id
    among them) is kept as its own finished error record.
    """

    __tablename__ = "batch_items"
    __table_args__ = (UniqueConstraint("batch_id", "line"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    line: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(String(500))
    valid: Mapped[bool] = mapped_column(Boolean, default=True)
    body: Mapped[dict[str, Any] | None]
    status: Mapped[str] = mapped_column(String(20))  # pending | done | error
    status_code: Mapped[int | None] = mapped_column(Integer)
    response: Mapped[dict[str, Any] | None]
    error: Mapped[dict[str, Any] | None]
    request_id: Mapped[str | None] = mapped_column(String(80))
    finished_at: Mapped[datetime | None]
    # The batch runner that claimed the item and until when (renewed while it runs): after
    # that another runner may take it over (`batch/leases.py`).
    lease_owner: Mapped[str | None] = mapped_column(String(100))
    lease_expires_at: Mapped[datetime | None]


Index("ix_batch_items_pending", BatchItem.batch_id, BatchItem.status)
Index(
    "uq_batch_items_custom_id",
    BatchItem.batch_id,
    BatchItem.custom_id,
    unique=True,
    sqlite_where=text("valid"),
    postgresql_where=text("valid"),
)


class AuditEvent(Base):
    """One change to an endpoint, key, tenant or registry version: who, what, when, and the
    public views before and after (never a secret). Written by `control.audit.AuditLog`."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    at: Mapped[datetime]
    # The tenant whose resource changed (what scopes reads); None for platform-wide changes.
    tenant_id: Mapped[str | None] = mapped_column(String(40))
    # Who: the API key and its tenant; both None for the platform itself (automatic rollback).
    actor_key_id: Mapped[str | None] = mapped_column(String(40))
    actor_tenant_id: Mapped[str | None] = mapped_column(String(40))
    action: Mapped[str] = mapped_column(String(60))  # e.g. endpoint.deploy, key.revoke
    target_type: Mapped[str] = mapped_column(String(40))  # endpoint | api_key | tenant | …
    target_id: Mapped[str] = mapped_column(String(300))
    before: Mapped[dict[str, Any] | None]
    after: Mapped[dict[str, Any] | None]


Index("ix_audit_tenant_at", AuditEvent.tenant_id, AuditEvent.at)
Index("ix_audit_at", AuditEvent.at)
Index("ix_audit_target", AuditEvent.target_type, AuditEvent.target_id)


class RoutingEntry(Base):
    """An endpoint's routing entry as the leading controller published it (cluster mode):
    gateways mirror these into their own routing tables, applying an entry only when its
    `generation` is newer than the one they hold (`gateway/route_mirror.py`)."""

    __tablename__ = "routing_entries"

    endpoint_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger, index=True)
    removed: Mapped[bool] = mapped_column(Boolean, default=False)  # a tombstone: no new requests
    entry: Mapped[dict[str, Any]]  # `control/route_publisher.entry_of`'s dict
    updated_at: Mapped[datetime]


class LimitsJournalEntry(Base):
    """A settlement of the limits store (quota moves, a slot to release) that Redis could not
    take when it happened, kept until a gateway applies it to the Redis it was meant for
    (`gateway/settlement_journal.py`): `epoch` names that Redis's data set, `id` is the marker
    that makes the application happen once."""

    __tablename__ = "limits_journal"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(40))
    epoch: Mapped[str] = mapped_column(String(40))
    change: Mapped[dict[str, Any]]  # {"moves": [[month, tokens], ...], "slot": [scope, id] | None}
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
