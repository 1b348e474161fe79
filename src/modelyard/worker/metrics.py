"""Prometheus metrics of a worker: latency histograms observed per request, engine gauges and
counters read from the engine at scrape time."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from modelyard.engine.llm_engine import LLMEngine

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _EngineCollector(Collector):
    def __init__(self, engine: LLMEngine, model: str) -> None:
        self.engine = engine
        self.model = model

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        e = self.engine
        labels = ["model"]
        value = [self.model]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge(
            "modelyard_num_requests_running", "Sequences in the running batch.", e.num_running
        )
        yield gauge("modelyard_num_requests_waiting", "Sequences waiting to run.", e.num_waiting)
        yield gauge("modelyard_kv_cache_usage_ratio", "Fraction of KV blocks in use.", e.kv.usage())
        yield gauge(
            "modelyard_kv_cache_capacity_tokens", "Tokens the KV cache holds.", e.token_capacity
        )
        queries, hits = e.kv.prefix_queries, e.kv.prefix_hits
        yield gauge(
            "modelyard_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up.",
            hits / queries if queries else 0.0,
        )
        yield counter(
            "modelyard_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            queries,
        )
        yield counter(
            "modelyard_prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits
        )
        s = e.stats
        yield counter("modelyard_prompt_tokens", "Prompt tokens computed.", s.prompt_tokens)
        yield counter("modelyard_generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("modelyard_engine_steps", "Engine steps run.", s.steps)
        yield counter(
            "modelyard_engine_failed_steps",
            "Engine steps that raised (their requests were retried one by one).",
            s.failed_steps,
        )
        yield counter(
            "modelyard_engine_busy_seconds", "Seconds the engine spent in steps.", s.busy_seconds
        )
        yield counter(
            "modelyard_num_preemptions", "Sequences preempted.", e.scheduler.num_preemptions
        )
        finished = CounterMetricFamily(
            "modelyard_request_success",
            "Finished requests by finish reason.",
            labels=["model", "finish_reason"],
        )
        for reason, n in sorted(s.requests_finished.items()):
            finished.add_metric([self.model, reason], n)
        yield finished


class WorkerMetrics:
    def __init__(self, engine: LLMEngine, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model))
        self.ttft = Histogram(
            "modelyard_time_to_first_token_seconds",
            "Time to first token.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.itl = Histogram(
            "modelyard_inter_token_latency_seconds",
            "Time between two outputs of a stream.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.e2e = Histogram(
            "modelyard_e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's TTFT, inter-token gaps and end-to-end latency."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last: float | None = None
        self.ttft: float | None = None

    def tokens(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.ttft = now - self.start
            self.metrics.ttft.observe(self.ttft)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def done(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)
