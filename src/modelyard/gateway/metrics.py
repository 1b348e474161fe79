"""Prometheus metrics of the gateway: requests, latency, TTFT, retries, limits, replicas."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "modelyard_gateway_requests",
            "Inference requests by model and status code.",
            ["model", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "modelyard_gateway_request_latency_seconds",
            "Gateway end-to-end latency.",
            ["model"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "modelyard_gateway_time_to_first_token_seconds",
            "First content byte of streams.",
            ["model"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "modelyard_gateway_upstream_retries",
            "Requests re-sent to another replica.",
            registry=r,
        )
        self.limited = Counter(
            "modelyard_gateway_rate_limited",
            "Requests refused by limits.",
            ["reason"],
            registry=r,
        )
        self.tokens = Counter(
            "modelyard_gateway_tokens",
            "Tokens metered.",
            ["model", "kind"],
            registry=r,
        )
        self.replicas = Gauge(
            "modelyard_endpoint_replicas",
            "Replicas by endpoint and state.",
            ["endpoint", "model", "state"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
