"""Prometheus metrics of a worker: per-request histograms (latencies, tokens, and the phases
of a request in the engine: queue, prefill, decode), engine gauges and counters read from the
engine at scrape time.

Every engine series is exported twice: under modelyard's own name (label `model`) and under the
name vLLM gives it (label `model_name`, e.g. `vllm:kv_cache_usage_perc`), so that dashboards
and alerts written for vLLM read a modelyard replica as they read a vLLM server. The gateway
re-exposes both, with endpoint, replica, version and tenant labels added, and may drop one
naming (`metrics_names`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from modelyard.engine.client import EngineClient, RequestOutput

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

# modelyard's histogram -> vLLM's names for the same observations. vLLM v1 calls the gap between
# two outputs inter_token_latency; older dashboards read time_per_output_token (same data here).
_VLLM_HISTOGRAMS = {
    "modelyard_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "modelyard_inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "modelyard_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "modelyard_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "modelyard_request_generation_tokens": ("vllm:request_generation_tokens",),
    "modelyard_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "modelyard_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "modelyard_request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "modelyard_request_inference_time_seconds": ("vllm:request_inference_time_seconds",),
}
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000,
                  50_000, 100_000)  # fmt: skip
# Per-request histograms: name -> (help, buckets).
_HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "modelyard_time_to_first_token_seconds": ("Time to first token.", _LATENCY_BUCKETS),
    "modelyard_inter_token_latency_seconds": (
        "Time between two outputs of a stream.",
        _LATENCY_BUCKETS,
    ),
    "modelyard_e2e_request_latency_seconds": (
        "Request latency, arrival to last token.",
        _LATENCY_BUCKETS,
    ),
    "modelyard_request_prompt_tokens": ("Prompt tokens of a finished request.", _TOKEN_BUCKETS),
    "modelyard_request_generation_tokens": (
        "Tokens generated for a finished request (all its choices).",
        _TOKEN_BUCKETS,
    ),
    "modelyard_request_queue_time_seconds": (
        "Time a request waited in the engine before its first batch.",
        _LATENCY_BUCKETS,
    ),
    "modelyard_request_prefill_time_seconds": (
        "Time from a request's first batch to its first token (prefill).",
        _LATENCY_BUCKETS,
    ),
    "modelyard_request_decode_time_seconds": (
        "Time from a request's first token to its last (decode).",
        _LATENCY_BUCKETS,
    ),
    "modelyard_request_inference_time_seconds": (
        "Time from a request's first batch to its last token (prefill + decode).",
        _LATENCY_BUCKETS,
    ),
}


class _EngineCollector(Collector):
    def __init__(self, engine: EngineClient, model: str) -> None:
        self.engine = engine
        self.model = model

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.engine.snapshot()
        queries, hits = s.prefix_cache_queries, s.prefix_cache_hits
        # (modelyard name, vLLM names, help, value); counters are named without `_total`.
        gauges: list[tuple[str, tuple[str, ...], str, float]] = [
            ("modelyard_num_requests_running", ("vllm:num_requests_running",),
             "Sequences in the running batch.", s.running),
            ("modelyard_num_requests_waiting", ("vllm:num_requests_waiting",),
             "Sequences waiting to run.", s.waiting),
            # vLLM's "perc" is a fraction too (1 = 100 %); gpu_cache_usage_perc is its older name.
            ("modelyard_kv_cache_usage_ratio",
             ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
             "Fraction of KV blocks in use.", s.kv_cache_usage),
            ("modelyard_kv_cache_capacity_tokens", (), "Tokens the KV cache holds.",
             s.kv_cache_capacity_tokens),
            ("modelyard_prefix_cache_hit_rate", (),
             "Prompt tokens served from the prefix cache / prompt tokens looked up.",
             hits / queries if queries else 0.0),
            ("modelyard_kv_swap_capacity_blocks", (),
             "KV blocks the swap pool holds (0: no pool, preemption recomputes).",
             s.kv_swap_capacity_blocks),
            ("modelyard_kv_swap_used_blocks", (),
             "KV blocks of swapped-out sequences in the swap pool.", s.kv_swap_used_blocks),
            ("modelyard_spec_decode_acceptance_rate", (),
             "Draft tokens accepted / draft tokens verified (speculative decoding).",
             s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0),
            ("modelyard_spec_decode_tokens_per_step", (),
             "Tokens a sequence gains per step that verifies a draft (1 + accepted).",
             s.spec_emitted_tokens / s.spec_drafts if s.spec_drafts else 0.0),
        ]  # fmt: skip
        counters: list[tuple[str, tuple[str, ...], str, float]] = [
            ("modelyard_prefix_cache_queries", ("vllm:prefix_cache_queries",),
             "Prompt tokens looked up in the prefix cache.", queries),
            ("modelyard_prefix_cache_hits", ("vllm:prefix_cache_hits",),
             "Prompt tokens found in the prefix cache.", hits),
            ("modelyard_prompt_tokens", ("vllm:prompt_tokens",), "Prompt tokens computed.",
             s.prompt_tokens),
            ("modelyard_generation_tokens", ("vllm:generation_tokens",), "Tokens generated.",
             s.generation_tokens),
            ("modelyard_engine_steps", (), "Engine steps run.", s.steps),
            ("modelyard_engine_failed_steps", (),
             "Engine steps that raised (their requests were retried one by one).",
             s.failed_steps),
            ("modelyard_engine_interrupted_steps", (),
             "Engine steps of batch work alone stopped between layers for a real-time request "
             "(each runs again).", s.interrupted_steps),
            ("modelyard_engine_busy_seconds", (), "Seconds the engine spent in steps.",
             s.busy_seconds),
            ("modelyard_num_preemptions", ("vllm:num_preemptions",), "Sequences preempted.",
             s.preemptions),
            ("modelyard_kv_swapped_out_blocks", (),
             "KV blocks copied into the swap pool by preemptions.", s.kv_swapped_out_blocks),
            ("modelyard_kv_swapped_in_blocks", (),
             "KV blocks copied back from the swap pool by resumed sequences.",
             s.kv_swapped_in_blocks),
            ("modelyard_spec_decode_num_drafts", ("vllm:spec_decode_num_drafts",),
             "Drafts verified (one per sequence and step).", s.spec_drafts),
            ("modelyard_spec_decode_num_draft_tokens", ("vllm:spec_decode_num_draft_tokens",),
             "Draft tokens verified.", s.spec_draft_tokens),
            ("modelyard_spec_decode_num_accepted_tokens",
             ("vllm:spec_decode_num_accepted_tokens",), "Draft tokens accepted.",
             s.spec_accepted_tokens),
        ]  # fmt: skip
        for name, aliases, doc, value in gauges:
            for n, label in ((name, "model"), *((a, "model_name") for a in aliases)):
                g = GaugeMetricFamily(n, doc, labels=[label])
                g.add_metric([self.model], value)
                yield g
        for name, aliases, doc, value in counters:
            for n, label in ((name, "model"), *((a, "model_name") for a in aliases)):
                c = CounterMetricFamily(n, doc, labels=[label])
                c.add_metric([self.model], value)
                yield c
        c = CounterMetricFamily(
            "modelyard_preemptions",
            "Sequences preempted, by their priority and how they come back (swap, recompute).",
            labels=["model", "priority", "mode"],
        )
        for (priority, mode), count in sorted(s.preemptions_by.items()):
            c.add_metric([self.model, str(priority), mode], count)
        yield c
        finished = sorted(s.requests_finished.items())
        for n, labels in (
            ("modelyard_request_success", ["model", "finish_reason"]),
            ("vllm:request_success", ["model_name", "finished_reason"]),
        ):
            c = CounterMetricFamily(n, "Finished requests by finish reason.", labels=labels)
            for reason, count in finished:
                c.add_metric([self.model, reason], count)
            yield c


class _VllmHistograms(Collector):
    """The request histograms again under vLLM's names, with `model_name` for `model`."""

    def __init__(self, histograms: Iterable[Histogram]) -> None:
        self.histograms = list(histograms)

    def collect(self) -> Iterator[Metric]:
        for histogram in self.histograms:
            for family in histogram.collect():
                for alias in _VLLM_HISTOGRAMS.get(family.name, ()):
                    yield _renamed(family, alias)


def _renamed(family: Metric, name: str) -> Metric:
    out = Metric(name, family.documentation, family.type)
    for s in family.samples:
        labels = {("model_name" if k == "model" else k): v for k, v in s.labels.items()}
        out.samples.append(
            Sample(name + s.name[len(family.name) :], labels, s.value, s.timestamp, s.exemplar)
        )
    return out


class WorkerMetrics:
    def __init__(self, engine: EngineClient, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model))
        histograms = {
            name: Histogram(name, doc, ["model"], buckets=buckets, registry=self.registry)
            for name, (doc, buckets) in _HISTOGRAMS.items()
        }
        self.registry.register(_VllmHistograms(histograms.values()))
        h = {
            name.removeprefix("modelyard_"): hist.labels(model) for name, hist in histograms.items()
        }
        self.ttft = h["time_to_first_token_seconds"]
        self.itl = h["inter_token_latency_seconds"]
        self.e2e = h["e2e_request_latency_seconds"]
        self.prompt_tokens = h["request_prompt_tokens"]
        self.generation_tokens = h["request_generation_tokens"]
        self.queue_time = h["request_queue_time_seconds"]
        self.prefill_time = h["request_prefill_time_seconds"]
        self.decode_time = h["request_decode_time_seconds"]
        self.inference_time = h["request_inference_time_seconds"]

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one API request: its TTFT, inter-token gaps and end-to-end latency as the
    worker sees them, and from its engine requests' outputs (the earliest of them when a list of
    prompts fans out) its time queued in the engine, prefill, decode, and its token counts."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()  # the engine's clock: its outputs' times compare with it
        self.last: float | None = None
        self.ttft: float | None = None
        self.first_token: float | None = None
        self.arrival: float | None = None
        self.scheduled: float | None = None

    def output(self, out: RequestOutput) -> None:
        """One engine output of this request, as it arrives."""
        scheduled = out.first_scheduled
        if scheduled is not None and (self.scheduled is None or scheduled < self.scheduled):
            self.scheduled, self.arrival = scheduled, out.arrival
        if any(d.token_ids for d in out.deltas):
            self.tokens()

    def tokens(self) -> None:
        now = time.monotonic()
        if self.last is None:
            self.ttft = now - self.start
            self.first_token = now
            self.metrics.ttft.observe(self.ttft)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def done(self, prompt_tokens: int, generation_tokens: int) -> None:
        m = self.metrics
        now = time.monotonic()
        m.e2e.observe(now - self.start)
        m.prompt_tokens.observe(prompt_tokens)
        m.generation_tokens.observe(generation_tokens)
        if self.scheduled is None or self.arrival is None:
            return  # never reached a batch (nothing to say of its phases)
        last = self.last if self.last is not None else now
        m.queue_time.observe(max(0.0, self.scheduled - self.arrival))
        m.inference_time.observe(max(0.0, last - self.scheduled))
        if self.first_token is not None:
            m.prefill_time.observe(max(0.0, self.first_token - self.scheduled))
            m.decode_time.observe(last - self.first_token)
