"""Prometheus metrics of an encoder worker: requests, items, batch sizes and latencies observed
as they happen, the host's loaded models and memory read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from modelyard.encoders.host import ModelHost

_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_LATENCY_BUCKETS = (
    0.002,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.15,
    0.3,
    0.6,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
)


class _HostCollector(Collector):
    def __init__(self, host: ModelHost) -> None:
        self.host = host

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self.host.status()
        loaded = GaugeMetricFamily(
            "modelyard_encoder_model_loaded", "1 if the model is loaded.", labels=["model"]
        )
        memory = GaugeMetricFamily(
            "modelyard_encoder_model_memory_bytes", "Memory of a loaded model.", labels=["model"]
        )
        for s in status:
            loaded.add_metric([s.name], 1.0 if s.loaded else 0.0)
            memory.add_metric([s.name], float(s.memory_bytes))
        yield loaded
        yield memory
        yield GaugeMetricFamily(
            "modelyard_encoder_models_loaded",
            "Models loaded.",
            value=sum(s.loaded for s in status),
        )
        yield GaugeMetricFamily(
            "modelyard_encoder_memory_used_bytes",
            "Memory the loaded models hold.",
            value=sum(s.memory_bytes for s in status),
        )
        yield GaugeMetricFamily(
            "modelyard_encoder_memory_budget_bytes",
            "Memory budget of the host.",
            value=self.host.memory_budget,
        )
        yield GaugeMetricFamily(
            "modelyard_encoder_evictions", "Models unloaded so far.", value=self.host.evictions
        )


class EncoderMetrics:
    def __init__(self, host: ModelHost) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_HostCollector(host))
        self.requests = Counter(
            "modelyard_encoder_requests",
            "Requests by model, API and HTTP status.",
            ["model", "api", "status"],
            registry=self.registry,
        )
        self.items = Counter(
            "modelyard_encoder_items",
            "Inputs run through a model.",
            ["model"],
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "modelyard_encoder_batch_size",
            "Inputs per batch run.",
            ["model"],
            buckets=_BATCH_SIZE_BUCKETS,
            registry=self.registry,
        )
        self.batch_seconds = Histogram(
            "modelyard_encoder_batch_seconds",
            "Wall-clock time of one batch run.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "modelyard_encoder_request_latency_seconds",
            "Request latency, arrival to response.",
            ["model", "api"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        host.add_batch_listener(self.observe_batch)

    def observe_batch(self, model: str, size: int, seconds: float) -> None:
        self.items.labels(model).inc(size)
        self.batch_size.labels(model).observe(size)
        self.batch_seconds.labels(model).observe(seconds)

    def observe_request(self, model: str, api: str, status: int, seconds: float) -> None:
        self.requests.labels(model, api, str(status)).inc()
        self.latency.labels(model, api).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
