"""Start a worker process: load the engine, then serve it with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
from pathlib import Path

import uvicorn

from modelyard.config import EngineSettings
from modelyard.engine.async_engine import AsyncEngine
from modelyard.engine.llm_engine import LLMEngine
from modelyard.worker.app import create_app

log = logging.getLogger(__name__)


def build_engine(model: str | Path, settings: EngineSettings) -> AsyncEngine:
    engine = LLMEngine.from_settings(model, settings)
    return AsyncEngine(engine, settings.request_timeout_s, settings.no_progress_timeout_s)


def serve_worker(
    model: str | Path,
    host: str,
    port: int,
    settings: EngineSettings,
    served_model_name: str | None = None,
    log_level: str = "info",
) -> None:
    engine = build_engine(model, settings)
    name = served_model_name or engine.engine.model_name
    app = create_app(engine, name)
    log.info("serving model %r on http://%s:%d/v1", name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
