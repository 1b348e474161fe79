"""Start a worker process: load the engine, then serve it with uvicorn until SIGINT/SIGTERM.

A worker whose engine died (a fatal step error, steps that keep failing, a dead
tensor-parallel rank) shuts itself down and exits non-zero, so the platform replaces it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import uvicorn

from modelyard.config import EngineSettings, TelemetrySettings
from modelyard.core.gc_pauses import freeze_heap_when_started
from modelyard.core.owner_watch import exit_if_orphaned
from modelyard.core.uvicorn_options import uvicorn_options
from modelyard.engine.client import LocalEngineClient
from modelyard.worker.app import create_app
from modelyard.worker.auth import configured_token
from modelyard.worker.load_estimate import reporting_load

log = logging.getLogger(__name__)

# Set by a platform that spawns this worker: the worker exits when that process dies.
PARENT_PID_ENV = "MODELYARD_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """If spawned by a platform process, get SIGTERM when it dies (Linux), or exit if it
    already has: no replica outlives a crashed or killed `modelyard serve`."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # it died before the signal was armed
        sys.exit(0)


# After the engine died, how long a graceful shutdown may take before a hard exit.
FAILURE_EXIT_S = 15.0


class _ExitOnFailure:
    """Stops the server when the engine dies: uvicorn finishes its graceful shutdown (no
    signal, which uvicorn would raise again on the way out and so hide the exit code), and a
    timer exits hard if that does not finish in time; `serve_worker` then exits non-zero."""

    def __init__(self) -> None:
        self.server: uvicorn.Server | None = None

    def __call__(self, why: str) -> None:
        log.error("%s; the worker exits", why)
        hard_exit = threading.Timer(FAILURE_EXIT_S, os._exit, (1,))
        hard_exit.daemon = True
        hard_exit.start()
        if self.server is None:
            os._exit(1)
        self.server.should_exit = True


def serve_worker(
    model: str | Path,
    host: str,
    port: int,
    settings: EngineSettings,
    served_model_name: str | None = None,
    log_level: str = "info",
) -> None:
    die_with_parent()
    with reporting_load(model, settings.cache_dir):  # the platform shows a replica's phase
        engine = LocalEngineClient.load(model, settings)
    exit_on_failure = _ExitOnFailure()
    engine.on_failure(exit_on_failure)
    try:
        name = served_model_name or engine.model_name
        app = create_app(engine, name, token=configured_token())
        log.info("serving model %r on http://%s:%d/v1", name, host, port)
        config = uvicorn.Config(
            app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
            **uvicorn_options(TelemetrySettings()),
        )  # fmt: skip
        exit_on_failure.server = uvicorn.Server(config)
        freeze_heap_when_started()
        if app.state.owner_watch is not None:
            app.state.owner_watch.server = exit_on_failure.server
        exit_on_failure.server.run()
    finally:
        engine.shutdown()  # the helper ranks, if uvicorn never ran the lifespan shutdown
    if engine.error is not None:
        sys.exit(1)
    exit_if_orphaned(app.state.owner_watch)  # no controller heartbeated it: code 4
