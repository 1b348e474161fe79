"""OpenTelemetry tracing, off unless `otel_endpoint` is set.

Configured, each process sends its spans to the OTLP/HTTP collector at `<otel_endpoint>/v1/traces`
(batched, in a thread of the SDK's); the W3C `traceparent` header carries a trace from the
gateway to the worker, so one request is one trace: gateway request → upstream call → worker
request → engine. Off, nothing of the SDK is imported and every helper here is a no-op that
costs one `is None` test. The provider is this module's own, not OpenTelemetry's global one, so
that no library instruments itself behind our back (FastAPI does when a global one is set).

The SDK is the optional extra `modelyard[otel]`.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from modelyard.config import TelemetrySettings

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"

_tracer: Any = None  # opentelemetry.trace.Tracer once configured
_provider: Any = None


def traces_url(endpoint: str) -> str:
    """The collector's traces path from its base URL (as OTEL_EXPORTER_OTLP_ENDPOINT is)."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else f"{base}/v1/traces"


def configure_tracing(settings: TelemetrySettings, service_name: str | None = None) -> bool:
    """Start exporting spans if `otel_endpoint` is set; True if tracing is on."""
    global _tracer, _provider
    if not settings.otel_endpoint:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            "otel_endpoint is set but the OpenTelemetry SDK is not installed: "
            "pip install 'modelyard[otel]'"
        ) from exc
    if _provider is not None:
        _provider.shutdown()
    name = service_name or settings.otel_service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    exporter = OTLPSpanExporter(endpoint=traces_url(settings.otel_endpoint), timeout=5)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
    _provider, _tracer = provider, provider.get_tracer("modelyard")
    atexit.register(shutdown_tracing)
    log.info("tracing: spans of %s go to %s", name, traces_url(settings.otel_endpoint))
    return True


def shutdown_tracing() -> None:
    """Send what is buffered and stop (at exit; tests call it to start over)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


@contextmanager
def span(
    name: str,
    kind: str = "internal",
    attributes: Mapping[str, Any] | None = None,
    parent: Mapping[str, str] | None = None,
) -> Iterator[Any]:
    """A span around the block, current inside it (child of the current one, or of the trace
    in `parent`'s `traceparent` header); yields None when tracing is off. `kind`: internal,
    server or client."""
    if _tracer is None:
        yield None
        return
    from opentelemetry.trace import SpanKind

    context = None
    if parent is not None and TRACEPARENT in parent:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = TraceContextTextMapPropagator().extract({TRACEPARENT: parent[TRACEPARENT]})
    with _tracer.start_as_current_span(
        name, context=context, kind=SpanKind[kind.upper()], attributes=dict(attributes or {})
    ) as current:
        yield current


def start_span(name: str, attributes: Mapping[str, Any] | None = None) -> Any:
    """A child of the current span that is not made current (for an async generator, whose
    context is its consumer's between yields); end it with `end_span`. None when off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, attributes=dict(attributes or {}))


def end_span(target: Any, error: BaseException | None = None) -> None:
    if target is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        target.record_exception(error)
        target.set_status(Status(StatusCode.ERROR, str(error)))
    target.end()


def outbound_headers() -> dict[str, str]:
    """`traceparent` of the current span for a request this process sends ({} when off)."""
    if _tracer is None:
        return {}
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier


def annotate(attributes: Mapping[str, Any]) -> None:
    """Attributes on the current span if it is still open (the gateway's request span gets the
    access line's fields: tenant, model, tokens …); None values skipped."""
    if _tracer is None:
        return
    from opentelemetry.trace import get_current_span

    current = get_current_span()
    if current.is_recording():
        current.set_attributes({k: v for k, v in attributes.items() if v is not None})


def set_attributes(target: Any, attributes: Mapping[str, Any]) -> None:
    """Attributes on a span from `span()` (nothing when it is None); None values skipped."""
    if target is not None:
        target.set_attributes({k: v for k, v in attributes.items() if v is not None})


def add_event(target: Any, name: str, attributes: Mapping[str, Any] | None = None) -> None:
    """An event on a span from `span()` (nothing when it is None)."""
    if target is not None:
        target.add_event(name, {k: v for k, v in (attributes or {}).items() if v is not None})
