"""Request bodies of the platform's own APIs (deploy, tenants, keys, registry), validated by
pydantic at the edge.

Bound before trust: every body refuses unknown fields, and every number, string, list and map in
it has a bound, so what a tenant admin stores is what the control plane can run (an endpoint's
stored `hardware`, `scaling`, `engine` and `sampling_defaults` are parsed again by these models
when it is adopted at a start: `control/endpoint_config.py`).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StringConstraints,
    field_validator,
    model_validator,
)

# A registry reference or a server path (the endpoint row's `artifact` column holds 1000).
ARTIFACT_MAX = 1000
# Engine options per deploy or canary: `EngineSettings` has fewer fields than this.
ENGINE_OPTIONS_MAX = 64
# An id the platform made (`ep-…`, `tn-…`, a version id): anything longer names nothing.
ID_MAX = 64


class Hardware(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu_type: str = Field(
        "cpu", max_length=64, description="Accelerator kind; informational on CPU nodes."
    )
    gpu_count: StrictInt = Field(1, ge=1, le=64)
    min_replicas: StrictInt = Field(1, ge=0, le=1000)
    max_replicas: StrictInt = Field(1, ge=1, le=1000)
    workload: Literal["real-time", "batch"] = Field(
        "real-time",
        description="batch: the endpoint serves batch work, so its replicas may run on spot "
        "nodes (node_provider ray; docs/scaling.md).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> Hardware:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be >= min_replicas")
        return self


class Scaling(BaseModel):
    """The endpoint's autoscaling policy (`control/autoscaler.py`): the metric and its target per
    replica, scale to zero, and the windows of the decision."""

    model_config = ConfigDict(extra="forbid")

    metric: Literal["gpu_utilization", "concurrency", "queue_depth", "requests_per_second"] = (
        "concurrency"
    )
    target_value: StrictFloat = Field(
        70.0, gt=0, le=1_000_000, description="Per replica; gpu_utilization in percent."
    )
    scale_to_zero: StrictBool = False
    scale_to_zero_after_idle_seconds: StrictInt = Field(300, ge=1, le=30 * 86_400)
    stable_window_seconds: StrictFloat = Field(60.0, gt=0, le=3_600)
    panic_window_seconds: StrictFloat = Field(6.0, gt=0, le=3_600)
    panic_threshold: StrictFloat = Field(
        2.0, ge=1.0, le=1_000, description="Panic when the panic window asks for this many "
        "times the current replicas.",
    )  # fmt: skip
    scale_down_delay_seconds: StrictFloat = Field(30.0, ge=0, le=86_400)


class SamplingDefaults(BaseModel):
    """What a request gets for the sampling fields it leaves out, e.g. the temperature a small
    model's card recommends; a request's own values always win."""

    model_config = ConfigDict(extra="forbid")

    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1, le=1_000_000)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0, le=100.0)


# An endpoint's name: parts of letters, digits, '.', '_', '-' (each starting with a letter or
# digit, so no '.' or '..' part) joined by '/'. It is what clients send as `model` and what
# the worker is told it serves; never a path, a query, a fragment or a control character.
ENDPOINT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$"


class DeployRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_name: str = Field(
        min_length=1,
        max_length=128,
        pattern=ENDPOINT_NAME_PATTERN,
        description="Letters, digits, '.', '_' and '-', each '/'-separated part starting with "
        "a letter or digit (e.g. `qwen2.5-0.5b` or `org/model`).",
    )
    model_artifact: str = Field(
        min_length=1,
        max_length=ARTIFACT_MAX,
        description="A registry reference (NAME or NAME:VERSION) or a folder/file path on the "
        "server.",
    )
    framework: str = Field("native", min_length=1, max_length=40)
    hardware: Hardware = Field(default_factory=Hardware)
    scaling: Scaling = Field(default_factory=Scaling)
    engine: dict[str, Any] = Field(
        default_factory=dict,
        max_length=ENGINE_OPTIONS_MAX,
        description="Engine settings for the replicas (dtype, kv_cache_memory, max_num_seqs, "
        "max_model_len, max_tokens_cap, ...).",
    )
    sampling_defaults: SamplingDefaults = Field(
        default_factory=SamplingDefaults,
        description="Sampling values for chat and completion requests that leave them out.",
    )
    public: StrictBool = Field(False, description="Visible to every tenant (platform admin only).")


class ReplicaLoadProgress(BaseModel):
    """`replicas.items[].load_progress` of the endpoint view: a starting replica's phase
    (`copying` the model files to the node, `loading` weights, `warming`, then `ready`)."""

    model_config = ConfigDict(extra="forbid")

    phase: Literal["copying", "loading", "warming", "ready"]
    fraction: float = Field(ge=0.0, le=1.0, description="Of the current phase.")
    bytes_done: int | None = Field(None, ge=0, description="Copying: bytes copied so far.")
    bytes_total: int | None = Field(None, ge=0, description="Copying: the model's bytes.")


TierName = Literal["free", "standard", "priority"]
# The columns are 32-bit (64-bit for the quota): larger numbers are a 400, not a database error.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# What the platform admin sets on a tenant and nobody else may change; None: no ceiling.
TENANT_CEILINGS = (
    "max_rpm",
    "max_tpm",
    "max_concurrent_requests",
    "max_concurrent_batch_items",
    "max_endpoints",
    "max_replicas",
    "max_storage_bytes",
)


class TenantCeilings(BaseModel):
    """The platform admin's limits on a tenant: its keys' rpm and tpm, work in flight, and
    what it may deploy. Its own admins can only tighten within them."""

    max_rpm: StrictInt | None = Field(
        None,
        ge=1,
        le=INT32_MAX,
        description="Requests per minute of all the tenant's keys together (and a ceiling on "
        "each key's rpm_limit).",
    )
    max_tpm: StrictInt | None = Field(
        None,
        ge=1,
        le=INT32_MAX,
        description="Tokens per minute of all the tenant's keys together (and a ceiling on "
        "each key's tpm_limit).",
    )
    max_concurrent_requests: StrictInt | None = Field(
        None, ge=1, le=INT32_MAX, description="Interactive requests in flight for the whole tenant."
    )
    max_concurrent_batch_items: StrictInt | None = Field(
        None, ge=1, le=INT32_MAX, description="Batch items in flight for the whole tenant."
    )
    max_endpoints: StrictInt | None = Field(None, ge=0, le=INT32_MAX, description="Live endpoints.")
    max_replicas: StrictInt | None = Field(
        None,
        ge=0,
        le=INT32_MAX,
        description="Sum of the live endpoints' hardware.max_replicas (each endpoint's versions, "
        "canaries included, run within its own).",
    )
    max_storage_bytes: StrictInt | None = Field(
        None,
        ge=0,
        le=INT64_MAX,
        description="Bytes of registry blobs and files the tenant may hold; unset: the "
        "platform's tenant_storage_bytes.",
    )


class TenantCreate(TenantCeilings):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    monthly_token_quota: StrictInt | None = Field(None, ge=0, le=INT64_MAX)
    tier: TierName = Field(
        "standard", description="Service tier: under overload, free waits first, priority last."
    )


class TenantUpdate(TenantCeilings):
    model_config = ConfigDict(extra="forbid")

    monthly_token_quota: StrictInt | None = Field(None, ge=0, le=INT64_MAX)
    tier: TierName | None = Field(None, description="free, standard or priority.")


KeyScope = Literal["inference", "admin", "metrics"]
# A key's allowed models: names or patterns where `*` matches any run of characters.
ALLOWED_MODELS_MAX = 100
ModelPattern = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/@*\-]+$")
]
ROTATION_GRACE_MAX_S = 30 * 86_400
EXPIRY_YEAR_MAX = 3000
_EXPIRES = "When the key stops working: ISO 8601 (UTC if no offset is given) or unix seconds."
_ALLOWED = (
    f"At most {ALLOWED_MODELS_MAX} model names the key may call; `*` matches any run of "
    "characters (`support-*`)."
)


def as_aware(value: datetime | None) -> datetime | None:
    """A datetime in UTC (one with no offset read as UTC), before the year `EXPIRY_YEAR_MAX`
    (every database reads it back)."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    try:
        value = value.astimezone(UTC)
    except OverflowError as exc:
        raise ValueError("out of range") from exc
    if value.year >= EXPIRY_YEAR_MAX:
        raise ValueError(f"must be before the year {EXPIRY_YEAR_MAX}")
    return value


def _inference_only() -> list[KeyScope]:
    return ["inference"]


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("default", min_length=1, max_length=200)
    tenant_id: str | None = Field(
        None, max_length=ID_MAX, description="Platform admin only: whose key this is."
    )
    scopes: list[KeyScope] = Field(
        default_factory=_inference_only,
        min_length=1,
        max_length=3,
        description="inference (the OpenAI API), admin (the tenant's management API), metrics "
        "(GET /metrics: the tenant's own series).",
    )
    rpm_limit: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    tpm_limit: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    expires_at: datetime | None = Field(None, description=_EXPIRES)
    allowed_models: list[ModelPattern] | None = Field(
        None, min_length=1, max_length=ALLOWED_MODELS_MAX, description=_ALLOWED
    )

    owner_user_id: str | None = Field(
        None,
        max_length=ID_MAX,
        description="A user of the tenant whose key this is (its "
        "scopes are cut to the user's role); a developer's own keys are always theirs.",
    )
    owner_team_id: str | None = Field(
        None, max_length=ID_MAX, description="A team of the tenant whose key this is."
    )

    @model_validator(mode="after")
    def _one_owner(self) -> KeyCreate:
        if self.owner_user_id is not None and self.owner_team_id is not None:
            raise ValueError("a key belongs to a user or to a team, not both")
        return self

    @field_validator("expires_at")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return as_aware(value)


class KeyUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=200)
    rpm_limit: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    tpm_limit: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    expires_at: datetime | None = Field(
        None, description=_EXPIRES + " null: never; a time already past expires it now."
    )
    allowed_models: list[ModelPattern] | None = Field(
        None, min_length=1, max_length=ALLOWED_MODELS_MAX, description=_ALLOWED + " null: all."
    )

    @field_validator("expires_at")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return as_aware(value)


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Strict, as every integer a key's owner writes: `true` is not read as 1 s.
    grace_period_seconds: StrictInt = Field(
        86_400,
        ge=0,
        le=ROTATION_GRACE_MAX_S,
        description="How long the replaced secret keeps working (0: it stops at once).",
    )


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: StrictInt | None = Field(None, ge=0, le=INT64_MAX)


# A path inside a model version (`model-00001-of-00030.safetensors`, `tokenizer/vocab.json`).
FilePath = Annotated[str, StringConstraints(min_length=1, max_length=1024)]


class VersionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    files: dict[FilePath, FileEntry] = Field(min_length=1, max_length=10_000)
    format: Literal["hf", "gguf", "lora"] | None = None
    # A lora adapter's base: a model of the same registry (required for lora, else refused).
    base_model: str | None = Field(None, min_length=1, max_length=200)
