"""`modelyard runtime`: one replica served by another runtime (llama.cpp, vLLM), in the platform's
terms.

The sidecar owns the replica's port. It starts the runtime's server as its child on a private
loopback port (the child dies with it: PR_SET_PDEATHSIG), and serves:

  * `/health`: the platform's load report (`status`, `running`, `waiting`, KV capacity,
    `max_concurrency` = the runtime's parallel slots, which caps the admission limit); 503 while
    the runtime loads or fails its own health check;
  * `/metrics`: the runtime's own series, plus those it has under modelyard's names (label
    `model`), so the gateway's federation and dashboards read it as a native replica;
  * everything else (the OpenAI routes): passed through as is, streamed.

It exits with the runtime's exit code when the runtime exits, so the platform replaces it, and
stops the runtime on SIGTERM. The runtime's output goes to the sidecar's (the replica's log).
Started by a cluster's controller, it exits (code 4) when no controller heartbeats it
(`PUT /admin/owner`, `core/owner_watch.py`), as a native replica does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

from modelyard.control.runtimes import llama_cpp, vllm
from modelyard.core.loop_monitor import watching_loop
from modelyard.core.owner_watch import (
    HEARTBEAT_PATH,
    ORPHANED_EXIT_CODE,
    OwnerWatch,
    configured_timeout,
)

log = logging.getLogger(__name__)

PARENT_PID_ENV = "MODELYARD_PARENT_PID"  # as `worker.server`: exit when the platform dies
_PR_SET_PDEATHSIG = 1
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te",
               "upgrade", "proxy-connection", "content-encoding"}  # fmt: skip


def _die_with(sig: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Mapped(Collector):
    """The runtime's parsed series, then those `mapping` renames, under modelyard's names."""

    def __init__(self, text: str, mapping: dict[str, str], model: str) -> None:
        self.families = list(text_string_to_metric_families(text))
        self.mapping, self.model = mapping, model

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield family
            target = self.mapping.get(family.name)
            if target is None:
                continue
            mapped = Metric(target, family.documentation, family.type)
            main = [s for s in family.samples if s.name in (family.name, family.name + "_total")]
            suffix = "_total" if family.type == "counter" else ""
            total = sum(s.value for s in main)
            mapped.samples.append(Sample(target + suffix, {"model": self.model}, total))
            yield mapped


def _gauge(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name == name)
    return 0.0


class Sidecar:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.runtime = llama_cpp if opts.framework == llama_cpp.NAME else vllm
        self.inner = f"http://127.0.0.1:{_free_port()}"
        self.child: subprocess.Popen[bytes] | None = None
        self.session: aiohttp.ClientSession | None = None

    def start_child(self) -> None:
        port = int(self.inner.rsplit(":", 1)[1])
        o = self.opts
        argv = self.runtime.command(
            o.executable, Path(o.model), o.served_model_name, port, o.slots, o.context,
            list(o.runtime_arg),
        )  # fmt: skip
        log.info("starting %s: %s", o.framework, " ".join(argv))
        self.child = subprocess.Popen(  # the runtime's output is the replica's log
            argv, stdin=subprocess.DEVNULL, preexec_fn=lambda: _die_with(signal.SIGKILL)
        )

    async def _get(self, path: str) -> tuple[int, str]:
        assert self.session is not None
        async with self.session.get(self.inner + path) as r:
            return r.status, await r.text()

    async def health(self, _: web.Request) -> web.Response:
        o = self.opts
        body: dict[str, object] = {"model": o.served_model_name, "runtime": o.framework}
        try:
            status, text = await self._get("/health")
        except aiohttp.ClientError as exc:
            return web.json_response({**body, "status": "loading", "error": repr(exc)}, status=503)
        if status != 200:
            body.update(status="error", error=f"{o.framework} health answered {status}")
            return web.json_response(body, status=503)
        running = waiting = 0.0
        with contextlib.suppress(aiohttp.ClientError, ValueError):
            status, text = await self._get("/metrics")
            if status == 200:
                running = _gauge(text, self.runtime.RUNNING)
                waiting = _gauge(text, self.runtime.WAITING)
        context = o.context or 0
        body.update(
            status="ok",
            running=int(running),
            waiting=int(waiting),
            kv_cache_capacity_tokens=o.slots * context,
            max_model_len=context or None,
            max_concurrency=o.slots,
        )
        return web.json_response(body)

    async def metrics(self, _: web.Request) -> web.Response:
        try:
            status, text = await self._get("/metrics")
        except aiohttp.ClientError:
            status, text = 503, ""
        if status != 200:
            return web.Response(status=503, text=f"{self.opts.framework} metrics unavailable\n")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Mapped(text, self.runtime.METRICS, self.opts.served_model_name))
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self.session.request(
            request.method, self.inner + request.rel_url.raw_path_qs, headers=headers,
            data=await request.read(),
        ) as upstream:  # fmt: skip
            out_headers = {
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP
            }
            response = web.StreamResponse(status=upstream.status, headers=out_headers)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def run(self) -> int:
        self.start_child()
        assert self.child is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        self.session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
        )
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        timeout_s = configured_timeout()
        watch = OwnerWatch(timeout_s) if timeout_s else None

        async def heartbeat(_: web.Request) -> web.Response:
            if watch is not None:
                watch.heard()
            return web.json_response({"watched": watch is not None})

        app.router.add_put(HEARTBEAT_PATH, heartbeat)
        app.router.add_route("*", "/{tail:.*}", self.proxy)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.opts.host, self.opts.port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("%s replica %r on http://%s:%d", self.opts.framework,
                 self.opts.served_model_name, self.opts.host, self.opts.port)  # fmt: skip
        if watch is not None:  # SIGTERM to itself when orphaned: the stop below
            watch.start()
        while not stop.is_set() and self.child.poll() is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        code = self.child.poll()
        if code is None:  # asked to stop: the runtime first, then the front
            self.child.terminate()
            try:
                await asyncio.to_thread(self.child.wait, 10)
            except subprocess.TimeoutExpired:
                self.child.kill()
            code = 0
        else:
            log.error("%s exited with code %s; the replica exits", self.opts.framework, code)
            code = code or 1
        await runner.cleanup()
        await self.session.close()
        if watch is not None:
            watch.stop()
            if watch.orphaned:
                return ORPHANED_EXIT_CODE
        return code


def serve_runtime(opts: argparse.Namespace) -> None:
    """Run the sidecar until SIGTERM or the runtime's exit (then exit with its code)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if parent and sys.platform.startswith("linux"):
        _die_with(signal.SIGTERM)
        if os.getppid() != int(parent):
            sys.exit(0)
    sys.exit(asyncio.run(_watched(Sidecar(opts))))


async def _watched(sidecar: Sidecar) -> int:
    with watching_loop():  # the loop-stall guard, when `loop_stall_ms` is set
        return await sidecar.run()
