"""Response schemas of the management routes (tenants, keys, usage, endpoints, the registry, the
fleet, webhooks), for the served OpenAPI document only.

Those handlers build plain dicts; these models validate nothing at run time. They say what a
client gets, `install_openapi` puts them on the routes (`RESPONSES`), and the schemathesis suite
checks every answer against them. Required fields are those every answer has; nullable ones say
so; objects may carry more fields than listed (a newer platform adds some).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class Tenant(BaseModel):
    id: str
    object: Literal["tenant"]
    name: str
    tier: str
    monthly_token_quota: int | None
    max_rpm: int | None
    max_tpm: int | None
    max_concurrent_requests: int | None
    max_concurrent_batch_items: int | None
    max_endpoints: int | None
    max_replicas: int | None
    max_storage_bytes: int | None = None
    system: bool = Field(description="The platform's own tenant (its admin is platform admin).")
    created_at: int


class TenantList(BaseModel):
    object: Literal["list"]
    data: list[Tenant]


class ApiKey(BaseModel):
    id: str
    object: Literal["api_key"]
    name: str
    tenant_id: str
    prefix: str = Field(description="The key's first characters, to recognise it.")
    scopes: list[str]
    rpm_limit: int | None
    tpm_limit: int | None
    owner_user_id: str | None = Field(None, description="The user whose key it is.")
    owner_team_id: str | None = Field(None, description="The team whose key it is.")
    created_at: int
    revoked_at: int | None
    expires_at: int | None = Field(description="Unix seconds; None: never.")
    allowed_models: list[str] | None = Field(description="Patterns (`*`); None: every model.")
    last_used_at: int | None = Field(description="Written at most once a minute per gateway.")
    previous_key_expires_at: int | None = Field(
        description="Until when the secret replaced by the last rotation works."
    )


class ApiKeyCreated(ApiKey):
    key: str = Field(description="The secret, shown in this answer only.")


class ApiKeyList(BaseModel):
    object: Literal["list"]
    data: list[ApiKey]


class UsageGroup(BaseModel):
    """One group; its key field is named after `group_by` (`model`, `key`, `team`, `day`,
    `version`)."""

    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int
    cost_usd: float
    cost_micro_usd: int = Field(description="The same cost in micro-dollars, exact.")


class UsageTotals(UsageGroup):
    pass


class UsageReport(BaseModel):
    object: Literal["usage"]
    start: int
    end: int
    group_by: str
    data: list[UsageGroup]
    totals: UsageTotals


class Device(BaseModel):
    name: str
    kind: str
    memory_bytes: int
    used_bytes: int
    replicas: list[str] = Field(description="Ids of the replicas placed on it.")


class DeviceList(BaseModel):
    object: Literal["list"]
    data: list[Device]


class RegistryVersion(BaseModel):
    id: str
    model: str
    version: int
    ref: str = Field(description="NAME:VERSION, what a deploy names.")
    format: str
    base_model: str | None
    total_size: int
    param_count: int | None = Field(
        None,
        description="Parameters, recorded when the version was pushed (what replicas are sized "
        "from); null for a version pushed before it was recorded, until first deployed.",
    )
    files: dict[str, Any] | None = None
    created_at: int | None = None


class RegistryModel(BaseModel):
    id: str
    name: str
    created_at: int
    versions: list[RegistryVersion]


class RegistryModelList(BaseModel):
    object: Literal["list"]
    data: list[RegistryModel]


class RegistryAdapter(BaseModel):
    object: Literal["registry.adapter"]
    name: str
    base_model: str = Field(description="The model of the endpoint serving it.")
    endpoint_id: str
    versions: list[int]
    loaded_replicas: int = Field(description="Replicas holding one of its versions in a slot.")
    state: str = Field(description="`loaded on N of M replicas`, or `cold`.")


class RegistryAdapterList(BaseModel):
    object: Literal["list"]
    data: list[RegistryAdapter]


class RegistryModelDeleted(BaseModel):
    name: str
    deleted: bool


class BlobStored(BaseModel):
    sha256: str
    size: int


class ScalingDecision(BaseModel):
    at: float
    current: int
    desired: int
    reason: str
    panic: bool


class Autoscaling(BaseModel):
    desired: int
    current: int
    last_decision: ScalingDecision | None
    recent_changes: list[ScalingDecision]


class LoadProgress(BaseModel):
    phase: str = Field(description="copying, loading, warming or ready.")
    fraction: float


class Replica(BaseModel):
    id: str
    state: str
    address: str | None
    started_at: int
    version_id: str | None
    error: str | None
    load_progress: LoadProgress | None


class Replicas(BaseModel):
    desired: int
    ready: int
    restarts: int
    last_error: str | None
    items: list[Replica]


class EndpointVersions(BaseModel):
    """The versions an endpoint serves (a canary, a previous one kept warm) and their weights."""

    weights: dict[str, int]
    canary: dict[str, Any] | None
    items: list[dict[str, Any]]
    last_rollback: dict[str, Any] | None


class VersionsRolledBack(EndpointVersions):
    rollback: dict[str, Any]
    took_ms: float


class Endpoint(BaseModel):
    endpoint_id: str
    object: Literal["endpoint"]
    model_name: str
    status: str
    status_message: str | None
    public: bool
    kind: str | None = Field(description="llm, or the encoder kind (embedding, classifier).")
    model_kind: str | None = Field(
        description="chat, completion, embedding or classifier, as /v1/models shows it."
    )
    model_artifact: str
    version_id: str | None
    rollout_from: str | None
    traffic: dict[str, int] = Field(description="Percent of requests per version id.")
    created_at: int
    endpoint_url: str
    autoscaling: Autoscaling
    replicas: Replicas
    versions: EndpointVersions


class EndpointList(BaseModel):
    object: Literal["list"]
    data: list[Endpoint]


class DeployAccepted(BaseModel):
    endpoint_id: str
    status: str
    estimated_ready_seconds: int
    endpoint_url: str


class EndpointChange(BaseModel):
    """An update or delete was accepted: the endpoint's status from here on."""

    endpoint_id: str
    status: str


class WebhookSecret(BaseModel):
    object: Literal["webhook.secret"]
    tenant_id: str
    secret: str = Field(description="whsec_…, Standard Webhooks' format.")
    format: str


class ModelPrice(BaseModel):
    object: Literal["model.price"]
    endpoint_id: str
    tenant_id: str
    input_usd_per_million: str = Field(description="Exact decimal dollars.")
    output_usd_per_million: str
    cached_input_usd_per_million: str | None
    batch_discount_percent: str
    updated_at: int


class AdapterPrice(BaseModel):
    object: Literal["adapter.price"]
    adapter: str = Field(description="The registry adapter's name (all its versions).")
    model_id: str
    tenant_id: str
    priced: bool = Field(description="false: its calls cost its base endpoint's prices.")
    input_usd_per_million: str | None = Field(description="Exact decimal dollars.")
    output_usd_per_million: str | None
    cached_input_usd_per_million: str | None
    batch_discount_percent: str | None
    updated_at: int | None


class Budget(BaseModel):
    object: Literal["budget"]
    id: str
    tenant_id: str
    scope: Literal["tenant", "key", "team"]
    subject_id: str
    period: Literal["day", "month"]
    limit_usd: str
    limit_micro_usd: int
    soft_limit_usd: str | None
    soft_limit_micro_usd: int | None
    webhook_url: str | None
    created_at: int


class BudgetWithSpend(Budget):
    period_key: str = Field(description="The current period: 2026-12-05 or 2026-12 (UTC).")
    spent_usd: str = Field(description="Billed plus held by requests in flight.")
    spent_micro_usd: int


class BudgetList(BaseModel):
    object: Literal["list"]
    data: list[BudgetWithSpend]


class BudgetDeleted(BaseModel):
    object: Literal["budget.deleted"]
    id: str
    deleted: bool


# (method, path) -> the model of the route's success answer.
RESPONSES: dict[tuple[str, str], type[BaseModel]] = {
    ("get", "/v1/tenants"): TenantList,
    ("post", "/v1/tenants"): Tenant,
    ("get", "/v1/tenants/{tenant_id}"): Tenant,
    ("patch", "/v1/tenants/{tenant_id}"): Tenant,
    ("get", "/v1/keys"): ApiKeyList,
    ("post", "/v1/keys"): ApiKeyCreated,
    ("get", "/v1/keys/{key_id}"): ApiKey,
    ("patch", "/v1/keys/{key_id}"): ApiKey,
    ("delete", "/v1/keys/{key_id}"): ApiKey,
    ("post", "/v1/keys/{key_id}/rotate"): ApiKeyCreated,
    ("get", "/v1/usage"): UsageReport,
    ("get", "/v1/devices"): DeviceList,
    ("get", "/v1/registry/models"): RegistryModelList,
    ("get", "/v1/registry/adapters"): RegistryAdapterList,
    ("get", "/v1/registry/models/{name}"): RegistryModel,
    ("delete", "/v1/registry/models/{name}"): RegistryModelDeleted,
    ("post", "/v1/registry/models/{name}/versions"): RegistryVersion,
    ("put", "/v1/blobs/{sha256}"): BlobStored,
    ("post", "/v1/models/deploy"): DeployAccepted,
    ("get", "/v1/endpoints"): EndpointList,
    ("get", "/v1/endpoints/{endpoint_id}"): Endpoint,
    ("patch", "/v1/endpoints/{endpoint_id}"): EndpointChange,
    ("delete", "/v1/endpoints/{endpoint_id}"): EndpointChange,
    ("post", "/v1/endpoints/{endpoint_id}/versions"): EndpointVersions,
    ("patch", "/v1/endpoints/{endpoint_id}/traffic"): EndpointVersions,
    ("post", "/v1/endpoints/{endpoint_id}/promote"): EndpointVersions,
    ("post", "/v1/endpoints/{endpoint_id}/rollback"): VersionsRolledBack,
    ("get", "/v1/webhooks/secret"): WebhookSecret,
    ("put", "/v1/prices/{endpoint}"): ModelPrice,
    ("get", "/v1/prices/{endpoint}"): ModelPrice,
    ("put", "/v1/prices/adapters/{name}"): AdapterPrice,
    ("get", "/v1/prices/adapters/{name}"): AdapterPrice,
    ("delete", "/v1/prices/adapters/{name}"): AdapterPrice,
    ("post", "/v1/budgets"): Budget,
    ("get", "/v1/budgets"): BudgetList,
    ("get", "/v1/budgets/{budget_id}"): BudgetWithSpend,
    ("patch", "/v1/budgets/{budget_id}"): Budget,
    ("delete", "/v1/budgets/{budget_id}"): BudgetDeleted,
    ("post", "/v1/webhooks/secret/rotate"): WebhookSecret,
}


# Links of the served document (what stateful fuzzing follows): a created resource's id, read
# from the create's answer, is the path parameter of the operations on that resource.
# (create method, create path) -> (id field of the answer, path parameter, [(method, path)]).
LINKS: dict[tuple[str, str], tuple[str, str, list[tuple[str, str]]]] = {
    ("post", "/v1/tenants"): (
        "id",
        "tenant_id",
        [("get", "/v1/tenants/{tenant_id}"), ("patch", "/v1/tenants/{tenant_id}")],
    ),
    ("post", "/v1/keys"): (
        "id",
        "key_id",
        [(m, "/v1/keys/{key_id}") for m in ("get", "patch", "delete")],
    ),
    ("post", "/v1/models/deploy"): (
        "endpoint_id",
        "endpoint_id",
        [(m, "/v1/endpoints/{endpoint_id}") for m in ("get", "patch", "delete")]
        + [("post", "/v1/endpoints/{endpoint_id}/versions")],
    ),
    ("post", "/v1/files"): (
        "id",
        "file_id",
        [(m, "/v1/files/{file_id}") for m in ("get", "delete")]
        + [("get", "/v1/files/{file_id}/content")],
    ),
    ("post", "/v1/budgets"): (
        "id",
        "budget_id",
        [(m, "/v1/budgets/{budget_id}") for m in ("get", "patch", "delete")],
    ),
    ("post", "/v1/batches"): (
        "id",
        "batch_id",
        [("get", "/v1/batches/{batch_id}"), ("post", "/v1/batches/{batch_id}/cancel")],
    ),
}
