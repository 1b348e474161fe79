"""Prometheus metrics of the gateway: the platform's own series, and the view one caller gets.

Counted as requests pass: answers by model and status, latency and time to first token, tokens
and refusals (429/503) by reason, per endpoint and tenant where a request has them. Read at
scrape time from what the control plane knows (`PlatformState`, built by the api layer):
replicas by state, the gateway's queue and requests in flight, autoscaling decisions. The
replicas' own engine series are added by `gateway.federation`; `view` then drops what the caller
may not see (a tenant's metrics key: only its own series) and the naming not wanted.

Labels follow vLLM's where they mean the same (`model_name`, the public model name); `tenant`
is the tenant that sent the request (request series and refusals) or owns the endpoint (endpoint
series). A refusal's tenant is the request's authenticated one (`REQUEST_TENANT`, set by the
gateway's key check; "" when the request was refused before a key was known): bounded by the
number of tenants, as the other request series are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_BUCKETS = (
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)

# The gateway's words for a refusal (the call sites' `limited.labels(...)`) -> the reason label.
REFUSAL_REASONS = {
    "requests": "rate_limit_rpm",
    "tokens": "rate_limit_tpm",
    "quota": "quota",
    "concurrency": "concurrency",
    "capacity": "queue_full",
}

_ENDPOINT = ["endpoint", "model_name", "tenant"]

# The tenant of the request being handled, once its key is known (`gateway.auth` sets it).
REQUEST_TENANT: ContextVar[str] = ContextVar("modelyard_request_tenant", default="")


@dataclass(frozen=True)
class EndpointSnapshot:
    """One endpoint as the control plane and the gateway see it at scrape time."""

    endpoint: str
    tenant: str  # the owner
    model_name: str
    queued: int  # waiting for admission at the gateway
    in_flight: int  # sent to a replica, not answered yet
    desired_replicas: int
    replicas: Mapping[str, int] = field(default_factory=dict)  # by replica state


@dataclass(frozen=True)
class PlatformState:
    endpoints: list[EndpointSnapshot] = field(default_factory=list)
    # (endpoint, direction up|down, reason) -> decisions so far
    decisions: Mapping[tuple[str, str, str], int] = field(default_factory=dict)


class _Refusals:
    """`limited.labels(reason).inc()` for the call sites: a 429 under its reason's label."""

    def __init__(self, rejected: Counter) -> None:
        self.rejected = rejected

    def labels(self, reason: str) -> Counter:
        return self.rejected.labels(
            "429", REFUSAL_REASONS.get(reason, reason), REQUEST_TENANT.get()
        )


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "modelyard_gateway_requests",
            "Answers relayed from replicas, by model and HTTP status.",
            ["model_name", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "modelyard_gateway_request_latency_seconds",
            "Gateway end-to-end latency of served requests.",
            _ENDPOINT,
            buckets=_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "modelyard_gateway_time_to_first_token_seconds",
            "First content byte of streams, as the gateway relays it.",
            _ENDPOINT,
            buckets=_BUCKETS,
            registry=r,
        )
        self.endpoint_requests = Counter(
            "modelyard_gateway_endpoint_requests",
            "Requests a replica answered, per endpoint and tenant, by HTTP status (the answers of "
            "modelyard_gateway_requests_total; refusals are modelyard_gateway_rejected_requests).",
            [*_ENDPOINT, "status"],
            registry=r,
        )
        self.tokens = Counter(
            "modelyard_gateway_tokens",
            "Tokens metered (kind prompt or completion).",
            [*_ENDPOINT, "kind"],
            registry=r,
        )
        self.retries = Counter(
            "modelyard_gateway_upstream_retries",
            "Requests re-sent to another replica.",
            registry=r,
        )
        self.rejected = Counter(
            "modelyard_gateway_rejected_requests",
            "Requests refused before a replica served them, by HTTP status (429, 503, 504) and "
            "reason (rate_limit_rpm, rate_limit_tpm, quota, concurrency, queue_full, "
            "limits_unavailable, model_unavailable, model_loading, no_capacity, …), per tenant.",
            ["status", "reason", "tenant"],
            registry=r,
        )
        self.limited = _Refusals(self.rejected)
        self.limits_degraded = Gauge(
            "modelyard_gateway_limits_degraded",
            "1 while this gateway's limits store (Redis) does not answer: requests are admitted "
            "on this gateway's shares of each limit (redis_outage=fail_open) or refused.",
            registry=r,
        )
        self.limits_gateways = Gauge(
            "modelyard_gateway_limits_gateways",
            "Live gateways as this gateway last counted them in Redis: during an outage each "
            "admits on 1/N of every limit.",
            registry=r,
        )
        self.counters_rebuilt = Counter(
            "modelyard_gateway_counters_rebuilt",
            "Rebuilds of counters in Redis from the usage rows made by this gateway, because the "
            "Redis answering had lost them (a restart, a failover): `quota` or `spend`.",
            ["counters"],
            registry=r,
        )
        self.local_admissions = Counter(
            "modelyard_gateway_local_admissions",
            "Requests admitted on this gateway's own shares of their limits while Redis did not "
            "answer (redis_outage=fail_open).",
            registry=r,
        )

    def served(
        self,
        endpoint: str,
        model_name: str,
        tenant: str,
        latency_s: float,
        ttft_s: float | None,
        prompt_tokens: int,
        completion_tokens: int,
        status: int = 200,
    ) -> None:
        """A request a replica served, as it is settled."""
        self.answered(endpoint, model_name, tenant, status)
        self.latency.labels(endpoint, model_name, tenant).observe(latency_s)
        if ttft_s is not None:
            self.ttft.labels(endpoint, model_name, tenant).observe(ttft_s)
        self.tokens.labels(endpoint, model_name, tenant, "prompt").inc(prompt_tokens)
        self.tokens.labels(endpoint, model_name, tenant, "completion").inc(completion_tokens)

    def answered(self, endpoint: str, model_name: str, tenant: str, status: int) -> None:
        """A replica answered a request (served, or its own error answer)."""
        self.endpoint_requests.labels(endpoint, model_name, tenant, str(status)).inc()

    def refused(self, status: int, reason: str) -> None:
        """A refusal the gateway answered itself (counted once, where it is answered)."""
        self.rejected.labels(str(status), reason, REQUEST_TENANT.get()).inc()

    def families(self, state: PlatformState) -> list[Metric]:
        """The counters so far and the platform's state now."""
        return [*self.registry.collect(), *_state_families(state)]


def _state_families(state: PlatformState) -> Iterator[Metric]:
    replicas = GaugeMetricFamily(
        "modelyard_endpoint_replicas",
        "Replicas by endpoint and state.",
        labels=[*_ENDPOINT, "state"],
    )
    desired = GaugeMetricFamily(
        "modelyard_endpoint_desired_replicas",
        "Replicas the autoscaler wants for the endpoint.",
        labels=_ENDPOINT,
    )
    queued = GaugeMetricFamily(
        "modelyard_gateway_queue_depth",
        "Requests waiting at the gateway for a replica with room.",
        labels=_ENDPOINT,
    )
    in_flight = GaugeMetricFamily(
        "modelyard_gateway_requests_in_flight",
        "Requests sent to a replica and not answered yet.",
        labels=_ENDPOINT,
    )
    decisions = CounterMetricFamily(
        "modelyard_autoscaling_decisions",
        "Changes of an endpoint's desired replicas, by direction (up, down) and reason (load, "
        "panic, idle, request, prewarm).",
        labels=[*_ENDPOINT, "direction", "reason"],
    )
    owners: dict[str, list[str]] = {}
    for e in state.endpoints:
        labels = [e.endpoint, e.model_name, e.tenant]
        owners[e.endpoint] = labels
        for replica_state, n in sorted(e.replicas.items()):
            replicas.add_metric([*labels, replica_state], n)
        desired.add_metric(labels, e.desired_replicas)
        queued.add_metric(labels, e.queued)
        in_flight.add_metric(labels, e.in_flight)
    for (endpoint, direction, reason), n in sorted(state.decisions.items()):
        if endpoint in owners:  # a deleted endpoint's count goes with it
            decisions.add_metric([*owners[endpoint], direction, reason], n)
    yield from (replicas, desired, queued, in_flight, decisions)


@dataclass(frozen=True)
class Audience:
    """Who reads /metrics: everything (None), or one tenant's series only."""

    tenant: str | None = None
    endpoints: frozenset[str] = frozenset()  # the tenant's own endpoints


def view(families: Iterable[Metric], audience: Audience, names: str = "both") -> bytes:
    """The exposition text of `families` for `audience`, with engine series under `names`
    (both, vllm, modelyard).

    A tenant sees a series only if it is its own: its `tenant` label is the tenant, or it has
    none and its `endpoint` is one of the tenant's; series of no endpoint (the platform's, the
    shared encoder host's) are the platform admin's."""
    kept: dict[str, Metric] = {}  # one family per name: the gateway's own series and the
    for family in families:  # replicas' of the same name (e.g. loop stalls) are merged
        if names == "vllm" and family.name in _VLLM_TWINS:
            continue
        if names == "modelyard" and family.name.startswith("vllm:"):
            continue
        # Counters' creation timestamps: noise for a scraper of the whole platform.
        samples = [
            s
            for s in family.samples
            if not s.name.endswith("_created")
            and (audience.tenant is None or _owned(s.labels, audience))
        ]
        if not samples and audience.tenant is not None:
            continue  # an empty family still tells the admin what exists; a tenant, nothing
        copy = kept.get(family.name)
        if copy is None:
            copy = kept[family.name] = Metric(family.name, family.documentation, family.type)
        copy.samples.extend(samples)
    return generate_latest(_Families(list(kept.values())))


# modelyard's engine series that have a vLLM twin (dropped under metrics_names=vllm).
_VLLM_TWINS = frozenset(
    {
        "modelyard_num_requests_running",
        "modelyard_num_requests_waiting",
        "modelyard_kv_cache_usage_ratio",
        "modelyard_prefix_cache_queries",
        "modelyard_prefix_cache_hits",
        "modelyard_prompt_tokens",
        "modelyard_generation_tokens",
        "modelyard_num_preemptions",
        "modelyard_request_success",
        "modelyard_time_to_first_token_seconds",
        "modelyard_inter_token_latency_seconds",
        "modelyard_e2e_request_latency_seconds",
        "modelyard_request_prompt_tokens",
        "modelyard_request_generation_tokens",
        "modelyard_request_queue_time_seconds",
        "modelyard_request_prefill_time_seconds",
        "modelyard_request_decode_time_seconds",
        "modelyard_request_inference_time_seconds",
    }
)


def _owned(labels: Mapping[str, str], audience: Audience) -> bool:
    tenant = labels.get("tenant")
    if tenant is not None:
        return tenant == audience.tenant
    return labels.get("endpoint") in audience.endpoints


class _Families:
    """What `generate_latest` renders: a fixed list of families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families
