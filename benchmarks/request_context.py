"""What the request context and the access line cost the gateway per request, in-process.

Times, over the same run: a bare ASGI app called directly; the same app behind
`GatewayRequestContext` (a request id, contextvars, the `x-request-id` header); behind it with
tracing on (a server span per request, exported by the SDK's batch thread to a local collector
that answers 200 to everything); and one access line formatted and written (to a memory
buffer) in text and in JSON. Compare with the gateway's added latency in BENCHMARKS.md.

    python benchmarks/request_context.py [--requests 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import platform
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modelyard.config import TelemetrySettings
from modelyard.core import tracing
from modelyard.core.logs import JsonFormatter, TextFormatter
from modelyard.gateway import access_log
from modelyard.gateway.request_context import GatewayRequestContext

SCOPE = {
    "type": "http",
    "method": "POST",
    "path": "/v1/chat/completions",
    "headers": [(b"authorization", b"Bearer sk"), (b"x-request-id", b"client-1")],
}


class _Accept(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


async def bare_app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def _receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b""}


async def _send(message: Any) -> None:
    return None


async def per_call_us(app: Any, n: int) -> float:
    for _ in range(200):
        await app(SCOPE, _receive, _send)
    start = time.perf_counter()
    for _ in range(n):
        await app(SCOPE, _receive, _send)
    return (time.perf_counter() - start) / n * 1e6


def access_line_us(formatter: logging.Formatter, n: int) -> float:
    log = logging.getLogger("modelyard.access")
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(formatter)
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
    principal = SimpleNamespace(tenant_id="tn-1", key_id="key-1")
    route = SimpleNamespace(endpoint_id="ep-1", model_name="tiny", version_id="ver-1")
    call = SimpleNamespace(
        principal=principal, route=route, request_id="0" * 32, kind="chat.completions",
        status_code=200, status="ok", prompt_tokens=17, completion_tokens=3, cached_tokens=0,
        ttft=0.01, started=time.perf_counter(), batch=False,
    )  # fmt: skip
    event = SimpleNamespace(latency_ms=12.5, ttft_ms=10.0, version_id="ver-1")
    start = time.perf_counter()
    for _ in range(n):
        handler.stream.seek(0)
        handler.stream.truncate()
        access_log.log_access(call, True, event)  # type: ignore[arg-type]
    return (time.perf_counter() - start) / n * 1e6


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20000)
    n = ap.parse_args().requests
    rows: list[tuple[str, float]] = []
    rows.append(("bare ASGI app", asyncio.run(per_call_us(bare_app, n))))
    wrapped = GatewayRequestContext(bare_app)
    rows.append(("+ request context (tracing off)", asyncio.run(per_call_us(wrapped, n))))
    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Accept)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{collector.server_address[1]}"
    tracing.configure_tracing(TelemetrySettings(otel_endpoint=url), "bench")
    rows.append(("+ request context (tracing on)", asyncio.run(per_call_us(wrapped, n))))
    tracing.shutdown_tracing()
    collector.shutdown()
    rows.append(("access line, text", access_line_us(TextFormatter(), n)))
    rows.append(("access line, JSON", access_line_us(JsonFormatter(), n)))
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in _cpuinfo() if ln.startswith("model name")),
        platform.machine(),
    )
    print(f"machine: {cpu}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print(f"{'what':36} {'us per request':>15}")
    for what, us in rows:
        print(f"{what:36} {us:15.1f}")
    print(f"request context adds {rows[1][1] - rows[0][1]:.1f} us (tracing off), "
          f"{rows[2][1] - rows[0][1]:.1f} us (tracing on)")  # fmt: skip


if __name__ == "__main__":
    main()
