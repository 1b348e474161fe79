"""`PlatformSettings`: the knobs of `modelyard serve` (the gateway, the control plane and their
state), with the types of two of them: a model's prices and the prefix cache's scope."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from modelyard.config.capacity_settings import CapacitySettings
from modelyard.config.sources import parse_size


class ModelPrice(BaseModel):
    """USD per 1M tokens."""

    input: float = 0.0
    output: float = 0.0
    cached_input: float | None = None  # default: the input price


class PrefixCacheScope(enum.StrEnum):
    """Which requests may share an engine's prefix cache (a hit is visible in `cached_tokens`)."""

    TENANT = "tenant"  # one namespace per tenant: nobody learns what another tenant sent
    SHARED = "shared"  # one namespace for all: more hits, but the hits leak across tenants


class RedisOutage(enum.StrEnum):
    """What admission does while the limits store (Redis) does not answer at all."""

    # Each gateway admits on its share of every limit (the limit / the live gateways), the
    # quota from the last known counters; settlement is journaled and reconciled afterwards.
    FAIL_OPEN = "fail_open"
    FAIL_CLOSED = "fail_closed"  # every request whose limits live in Redis gets a 503


class PlatformSettings(CapacitySettings):
    """Knobs of `modelyard serve`: the gateway, the control plane and their state (single
    sign-on's: `sso_settings.py`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Field(Path(".modelyard"), description="SQLite file, artifacts, admin key.")
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL, e.g. postgresql://user@host/db; default SQLite. With "
        "standbys, libpq's multi-host form: "
        "postgresql://user@h1:5432,h2:5432/db?target_session_attrs=read-write.",
    )
    redis_url: str | None = Field(
        None,
        description="Shared rate limits and quotas across gateways: redis://host:6379[/db], or "
        "through Sentinel redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE_NAME[/DB].",
    )
    redis_timeout_s: float = Field(
        1.5,
        gt=0,
        description="Connect and read timeout of each Redis call (a dead connection: one retry).",
    )
    redis_outage: RedisOutage = Field(
        RedisOutage.FAIL_OPEN,
        description="While Redis does not answer: fail_open admits on per-gateway shares of "
        "each limit (docs/cluster.md); fail_closed answers 503 limits_unavailable.",
    )
    default_models: bool = Field(True, description="Register and deploy the bundled models.")
    bundled_max_loras: int = Field(
        8,
        ge=0,
        le=256,
        description="LoRA slots (engine max_loras) of the bundled public LLM's replicas, so "
        "tenants' adapters pushed against it are served on its replicas; 0: none.",
    )
    max_body_bytes: int = Field(parse_size("8MiB"), description="Largest JSON request body.")
    max_artifact_bytes: int = Field(parse_size("64GiB"), description="Largest uploaded file.")
    gateway_connect_timeout_s: float = 2.0
    gateway_request_timeout_s: float = Field(
        130.0, description="Gateway-side limit of one proxied request (worker's own is 120 s)."
    )
    gateway_stream_idle_timeout_s: float = Field(
        35.0, description="A stream that sends nothing for this long is cut with an error event."
    )
    gateway_retries: int = Field(2, description="Other replicas tried before the first byte.")
    admission_timeout_s: float = Field(
        30.0, gt=0, description="How long a request may wait for a replica with room (then 429)."
    )
    admission_tokens_per_request: int = Field(
        1024,
        ge=1,
        description="The KV cache one request needs on average (tokens): a replica admits "
        "KV capacity / this many requests at once.",
    )
    admission_queue_size: int = Field(
        256, ge=0, description="Requests that may wait for room, per endpoint (then 429)."
    )
    scale_from_zero_timeout_s: float = Field(
        180.0, gt=0, description="How long a request waits for a scaled-to-zero model to load."
    )
    async_result_ttl_s: float = Field(600.0, gt=0, description="How long 202 results are kept.")
    replica_start_timeout_s: float = 300.0
    replica_drain_timeout_s: float = 30.0
    rollout_attempts: int = Field(
        3, ge=1, description="Failed loads of a new version before falling back to the last good."
    )
    rollback_grace_s: float = Field(
        600.0,
        ge=0,
        description="After a promotion, how long the previous version's replicas stay warm (at "
        "weight 0) so that a rollback moves traffic without loading anything.",
    )
    canary_max_error_rate_delta: float = Field(
        0.05, ge=0, le=1, description="Default SLO: canary error rate minus the stable's above "
        "this rolls the canary back.",
    )  # fmt: skip
    canary_max_p95_ratio: float = Field(
        2.0, gt=0, description="Default SLO: canary p95 latency (TTFT for streams) over the "
        "stable's above this rolls the canary back.",
    )  # fmt: skip
    canary_min_samples: int = Field(
        20, ge=1, description="Default SLO: requests each version needs in the window before "
        "it is judged.",
    )  # fmt: skip
    canary_window_s: float = Field(
        60.0, gt=0, description="Default SLO: the sliding window the canary is judged over."
    )
    health_check_interval_s: float = 2.0
    health_probe_timeout_s: float = Field(
        2.0, gt=0, description="A replica's /health that does not answer in this long failed."
    )
    replica_health_failures: int = Field(
        3,
        ge=1,
        description="Failed health probes in a row after which a replica is killed and replaced "
        "(one failed probe already takes it out of routing).",
    )
    usage_journal_fsync: bool = Field(
        False,
        description="fsync the usage journal on every answered request: a machine crash (not "
        "only a process crash) then loses no usage, at the cost of a disk flush per request.",
    )
    metrics_token: str | None = Field(
        None,
        description="Bearer token a Prometheus scraper may use for /metrics (or an admin key).",
    )
    metrics_names: Literal["both", "vllm", "modelyard"] = Field(
        "both",
        description="Names of the replicas' engine series on /metrics: both, vllm (vllm:…, "
        "what vLLM dashboards read) or modelyard (modelyard_…); platform series are modelyard_….",
    )
    metrics_scrape_timeout_s: float = Field(
        1.0, gt=0, description="How long /metrics waits for one replica's metrics (then skips it)."
    )
    prefix_cache_scope: PrefixCacheScope = Field(
        PrefixCacheScope.TENANT,
        description="tenant: each tenant's requests share cached prompt prefixes only among "
        "themselves; shared: across tenants too (more hits; a tenant can tell from a hit that "
        "someone sent the same prefix).",
    )
    prefix_aware_routing: bool = Field(
        True,
        description="With several replicas, send a request to the replica whose prefix cache "
        "holds the longest prefix of its prompt (each replica reports what it holds), within "
        "bounded load; off: always the least-loaded replica.",
    )
    cache_routing_load_factor: float = Field(
        1.0,
        ge=1.0,
        description="Cache-aware routing: a replica keeps its affinity only while its requests "
        "in flight stay below this factor of the fair share (the mean over the replicas, "
        "counting the request, rounded up); else the least-loaded replica takes the request.",
    )
    prefix_routing_load_factor: float = Field(
        1.25,
        ge=1.0,
        description="Adapter routing: a replica takes a registry adapter's request only while "
        "its requests in flight stay within this factor of the fair share (the mean over the "
        "replicas); else the adapter's next replica, then the least-loaded.",
    )
    local_artifact_roots: list[Path] = Field(
        default_factory=list,
        description="Folders whose models any tenant admin may deploy by path (the platform "
        "admin may deploy any path).",
    )
    artifact_store: Literal["local", "s3"] = Field(
        "local",
        description="Where model blobs live: local (the data dir) or s3 (s3_bucket, shared by "
        "every node; the Files API's files stay in the data dir).",
    )
    s3_bucket: str | None = Field(None, description="Bucket of the s3 artifact store.")
    s3_prefix: str = Field("modelyard/", description="Key prefix of the s3 artifact store.")
    s3_endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, …); default: AWS for the region."
    )
    s3_region: str | None = Field(None, description="S3 region (else the AWS config's).")
    s3_import_buckets: list[str] = Field(
        default_factory=list,
        description="Buckets any tenant admin may deploy from by s3://bucket/key reference "
        "(imported into the registry, hash-verified); empty: none.",
    )
    batch_lease_s: float = Field(
        30.0,
        gt=0,
        description="How long a batch runner's claim on an item lasts unless renewed; another "
        "runner takes an item over once its lease has expired.",
    )
    controller_lease_s: float = Field(
        6.0,
        gt=0,
        description="Cluster mode: the leading controller's lease; standbys try for it every "
        "third of it (a crashed leader's lock is freed at once, a hung one's after this).",
    )
    test_adopt_delay_s: float = Field(
        0.0,
        ge=0,
        le=600,
        description="Test only (never set it in production): a cluster leader's adoption of "
        "each endpoint's running replicas first waits this long on a thread, as a slow backend "
        "(Ray's control store) would; tests/platform/test_cluster_leader.py makes it longer "
        "than the lease.",
    )
    control_forward_timeout_s: float = Field(
        5.0,
        gt=0,
        le=600,
        description="Cluster mode: how long a gateway waits for the leader's answer to a "
        "forwarded control request before it asks the leader's /health (as long again): a "
        "leader that answers that is busy and is waited for (up to 600 s); one that does not "
        "is hung, and the request (its body kept, up to 1 MiB) goes once to the next leader, "
        "or is a retryable 503 no_leader.",
    )
    replica_owner_leases: float = Field(
        5.0,
        ge=0,
        description="Cluster mode: a replica (worker, encoder host; local or Ray) that no "
        "controller has sent a heartbeat for this many controller_lease_s exits on its own "
        "(every controller stopped, or none leads that long); the leader heartbeats its "
        "replicas every third of a lease and a standby that takes over resumes it. 0: never.",
    )
    advertise_url: str | None = Field(
        None,
        description="Cluster mode: the URL other processes reach this controller at (gateways "
        "forward control requests to the leader's); default http://<host>:<port>.",
    )
    cluster_secret: str | None = Field(
        None,
        min_length=32,
        description="Cluster mode (required there) and the ray backend: a secret every gateway "
        "and controller holds (e.g. `openssl rand -hex 32`), never stored by the platform. The "
        "leader signs the URL it advertises in Redis with it (HMAC-SHA256) and a gateway "
        "forwards control requests only to a URL whose signature verifies; worker replicas get "
        "a token derived from it and answer nothing but /health without it. Unset on serve: "
        "a random one for this process's own replicas (they die with it).",
    )
    routing_refresh_s: float = Field(
        2.0, gt=0, description="Cluster mode: a gateway's re-read of the shared routing table."
    )
    stale_route_wait_s: float = Field(
        3.0,
        ge=0,
        description="Cluster mode: how long a gateway waits for a fresh routing entry when a "
        "replica of its entry is gone, before answering 503.",
    )
    prices: dict[str, ModelPrice] = Field(
        default_factory=dict, description="Per model name: USD per 1M input/output tokens."
    )
    encoder_host_memory: int = Field(
        parse_size("2GiB"), description="Memory of the shared embedding/classifier host."
    )
    encoder_max_batch_size: int = Field(32, ge=1, description="Encoder inputs per batch.")
    encoder_max_wait_ms: float = Field(5.0, ge=0, description="How long a batch waits to fill.")
    devices: str | None = Field(
        None,
        description="This node's devices, e.g. cpu:4x6GiB or cuda:2x80GiB; default: the CUDA "
        "devices torch sees, else one CPU device of 80 % of RAM.",
    )
    replica_overhead_bytes: int = Field(
        parse_size("512MiB"), description="Device memory a replica needs beyond weights and KV."
    )
    node_cache_bytes: int = Field(
        parse_size("50GiB"), description="This node's cache of model files (LRU beyond it)."
    )
    warm_pool: dict[str, int] = Field(
        default_factory=dict,
        description="Registry model refs of the platform admin → idle preloaded replicas kept "
        'ready for a cold endpoint of the same version to take over, e.g. {"smollm2": 1}.',
    )
    scale_to_zero_reload_factor: float = Field(
        0.0,
        ge=0,
        description="> 0: an idle endpoint goes to zero after this many times its replicas' "
        "measured load time (60 s at least, its scale_to_zero_after_idle_seconds at most).",
    )
    prewarm_lead_s: float = Field(300.0, gt=0, description="How early predicted traffic wakes.")
    prewarm_min_requests: float = Field(
        1.0, gt=0, description="Predicted requests in an hour that make an idle endpoint warm."
    )
    max_file_bytes: int = Field(parse_size("512MiB"), description="Largest Files API upload.")
    tenant_storage_bytes: int = Field(
        parse_size("100GiB"),
        ge=0,
        description="Bytes of registry blobs and files a tenant may hold unless the platform "
        "admin sets its own max_storage_bytes (the system tenant has no quota).",
    )
    blob_reclaim_grace_s: float = Field(
        300.0,
        ge=0,
        description="Blobs no tenant holds any more are deleted once their bytes are this old "
        "(an upload of the same content in flight is never swept).",
    )
    blob_reclaim_interval_s: float = Field(
        600.0, gt=0, description="How often the controller sweeps blobs no tenant holds."
    )
    batch_max_line_bytes: int = Field(
        parse_size("1MiB"),
        ge=1024,
        description="Longest line of a batch input file (one request); a longer one refuses "
        "the upload (400 line_too_large), checked while it is copied.",
    )
    batch_max_file_bytes: int = Field(
        parse_size("100MiB"),
        ge=1,
        description="Largest batch input file (purpose batch), checked while it is copied.",
    )
    batch_concurrency: int = Field(
        8, ge=1, description="Batch items in flight per tenant (unless the tenant's own ceiling)."
    )
    batch_max_concurrency: int = Field(
        32, ge=1, description="Batch items in flight across all tenants of this gateway."
    )
    batch_item_attempts: int = Field(4, ge=1, description="Tries of an item on transient errors.")
    batch_discount: float = Field(0.5, ge=0.0, le=1.0, description="Price cut on batch tokens.")
    batch_poll_interval_s: float = Field(0.5, gt=0, description="How often new batches are seen.")
    batch_webhook_url: str | None = Field(
        None,
        description="Told when a batch of the system tenant ends (tenants' batches go only to "
        "their own metadata.webhook_url), signed with the system tenant's webhook secret.",
    )
    batch_webhook_hosts: list[str] = Field(
        default_factory=list,
        description="host:port entries a batch's metadata.webhook_url may point at (port "
        "default: the scheme's; *.domain or * for public addresses only); empty: none.",
    )
    llama_server_path: Path | None = Field(
        None,
        description="llama.cpp's llama-server for deploys with framework llama.cpp (default: "
        "llama-server on PATH, else the one `make llama-server` builds).",
    )
    worker_engine: dict[str, Any] = Field(
        default_factory=dict, description="Default engine settings for every worker."
    )
    backend: Literal["local", "ray"] = Field(
        "local",
        description="What runs the replicas: local (worker processes on this machine) or ray "
        "(each replica a Ray actor on the node Ray picks; needs the ray extra).",
    )
    ray_address: str | None = Field(
        None,
        description="The Ray cluster the ray backend joins, e.g. 10.0.0.5:6379 or auto (a "
        "cluster started on this machine); unset: a local Ray instance started by the platform.",
    )

    @field_validator(
        "max_body_bytes",
        "max_artifact_bytes",
        "max_file_bytes",
        "batch_max_line_bytes",
        "batch_max_file_bytes",
        "tenant_storage_bytes",
        "encoder_host_memory",
        "node_cache_bytes",
        "replica_overhead_bytes",
        mode="before",
    )
    @classmethod
    def _parse_size(cls, value: Any) -> int:
        return parse_size(value)

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'modelyard.db').resolve()}"
