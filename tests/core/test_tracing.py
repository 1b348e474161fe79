"""OpenTelemetry tracing: off by default (nothing of the SDK imported), and when `otel_endpoint`
names a collector, one request through a real `modelyard serve` is one trace across the gateway
and the worker: gateway request → upstream call → worker request → engine (with its events).

The collector is a small OTLP/HTTP server in this test that decodes the protobuf posts with the
`opentelemetry-proto` package.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from modelyard.core.tracing import traces_url
from tests.platform_harness import PlatformProcess, deploy, tiny_models_env

# The test extra installs them; under CI a missing one fails instead of skipping.
if not os.environ.get("CI"):
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    pytest.importorskip("opentelemetry.proto", reason="opentelemetry-proto is not installed")


class Collector:
    """Accepts OTLP/HTTP protobuf trace exports on /v1/traces and keeps the spans."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                    ExportTraceServiceResponse,
                )

                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                collector.add(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: Any) -> None:
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    span = {
                        "service": attrs.get("service.name"),
                        "name": s.name,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex() or None,
                        "events": [e.name for e in s.events],
                        "attributes": {a.key: a.value for a in s.attributes},
                    }
                    with self.lock:
                        self.spans.append(span)

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()


def test_traces_url() -> None:
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_off_by_default_nothing_of_opentelemetry_is_loaded() -> None:
    """modelyard's own modules import nothing of OpenTelemetry, and with tracing off not the
    trace SDK nor the exporter (libraries import parts of it by themselves when installed:
    FastAPI the API for its idle native instrumentation, redis-py the metrics SDK)."""
    code = """
import sys
import modelyard.core.logs, modelyard.core.tracing
from modelyard.config import TelemetrySettings
assert [m for m in sys.modules if m.startswith("opentelemetry")] == [], "core imported otel"
assert modelyard.core.tracing.configure_tracing(TelemetrySettings()) is False
# The gateway's app, and what the worker's imports of tracing are (the worker app itself
# loads torch: slow here, and it reaches OpenTelemetry only through core.tracing).
import modelyard.api.app, modelyard.gateway.upstream, modelyard.gateway.request_context
heavy = ("opentelemetry.sdk.trace", "opentelemetry.exporter", "opentelemetry.proto")
loaded = sorted(m for m in sys.modules if m.startswith(heavy))
assert loaded == [], loaded
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_OTEL")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, collector: Collector
) -> Iterator[PlatformProcess]:
    env = {**tiny_models_env(models_dir), "MODELYARD_OTEL_ENDPOINT": collector.url}
    p = PlatformProcess(tmp_path_factory.mktemp("trace-platform"), env)
    p.start()
    try:
        with p.api() as api:
            deploy(api, "tiny", str(models_dir / "tiny"))
        yield p
    finally:
        p.stop()


def _one(spans: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [s for s in spans if all(s.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, spans)
    return found[0]


def test_one_request_is_one_trace_across_gateway_worker_and_engine(
    platform: PlatformProcess, collector: Collector
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "trace me"}],
        "max_tokens": 4,
        "stream": True,
    }
    with platform.api() as api, api.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert b"[DONE]" in r.read()
        request_id = r.headers["x-request-id"]

    def request_spans() -> list[dict[str, Any]]:
        spans = collector.snapshot()
        roots = [
            s for s in spans
            if s["name"] == "POST /v1/chat/completions"
            and s["attributes"].get("request_id") is not None
            and s["attributes"]["request_id"].string_value == request_id
        ]  # fmt: skip
        if not roots:
            return []
        trace = roots[0]["trace_id"]
        return [s for s in spans if s["trace_id"] == trace]

    deadline = time.monotonic() + 30
    spans = request_spans()
    wanted = {"upstream", "worker POST /v1/chat/completions", "engine"}
    while not wanted <= {s["name"] for s in spans} and time.monotonic() < deadline:
        time.sleep(0.2)
        spans = request_spans()

    root = _one(spans, name="POST /v1/chat/completions", service="modelyard")
    assert root["parent"] is None  # the gateway starts the trace
    # The access line's fields, on the request's span (its settlement ran before it ended).
    assert root["attributes"]["model"].string_value == "tiny"
    assert root["attributes"]["completion_tokens"].int_value > 0
    assert root["attributes"]["tenant"].string_value.startswith("tn-")
    upstream = _one(spans, name="upstream", service="modelyard")
    assert upstream["parent"] == root["span_id"]
    worker = _one(spans, name="worker POST /v1/chat/completions", service="modelyard-worker")
    assert worker["parent"] == upstream["span_id"]  # through traceparent
    assert worker["attributes"]["request_id"].string_value == request_id
    engine = _one(spans, name="engine", service="modelyard-worker")
    assert engine["parent"] == worker["span_id"]
    assert engine["events"] == ["queued", "first_token", "finished"]
    assert engine["attributes"]["engine.request_id"].string_value.startswith(request_id)
    # The harness polled /health while serve started; those spans would have been sent by now.
    assert not [s for s in collector.snapshot() if "/health" in s["name"]]
