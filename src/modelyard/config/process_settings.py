"""Settings every process reads besides its role's own: its logs and traces
(`TelemetrySettings`) and, on a worker replica, what it demands of its callers
(`WorkerAuthSettings`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from modelyard.config.sources import SettingsBase


class TelemetrySettings(SettingsBase):
    """Logs and traces of every process (`serve`, `worker`, `encoders`); a replica inherits
    its platform's (environment and TOML file). Kept apart from `EngineSettings` on purpose: a
    deploy body's `engine` options must never point a worker's traces somewhere else."""

    log_format: Literal["text", "json"] = Field(
        "text", description="text: one human line per record; json: one JSON object per line."
    )
    log_level: str = Field(
        "info", description="debug, info, warning, error; debug adds per-request worker lines."
    )
    otel_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP collector base URL (e.g. http://127.0.0.1:4318): traces are "
        "sent to its /v1/traces; unset: no tracing, nothing of OpenTelemetry is loaded.",
    )
    otel_service_name: str = Field(
        "modelyard", description="service.name of the spans (workers add '-worker')."
    )
    loop_stall_ms: float = Field(
        0,
        ge=0,
        description="> 0: a watchdog thread records every time this process's event loop is "
        "held by one piece of work longer than this many ms (e.g. 250): a WARNING line with the "
        "work's stack, and modelyard_event_loop_stalls_total / _stall_seconds on /metrics; "
        "0 = off.",
    )
    loop_stall_log: Path | None = Field(
        None,
        description="With loop_stall_ms: also append each stall as one JSON line to this file "
        "(every process of a platform may share it; the test suite reads it).",
    )

    @field_validator("loop_stall_ms")
    @classmethod
    def _stall_ms(cls, value: float) -> float:
        if 0 < value < 10:
            raise ValueError("loop_stall_ms must be 0 (off) or at least 10")
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"log_level must be debug, info, warning or error, not {value!r}")
        return value.lower()


class WorkerAuthSettings(SettingsBase):
    """What a worker replica demands of its callers; set by the platform that starts it."""

    worker_token: str | None = Field(
        None,
        description="Set by the platform on the replicas it starts (never by hand): with it, a "
        "worker answers only requests carrying `Authorization: Bearer <token>` (401 otherwise), "
        "/health excepted. Derived from cluster_secret (see there).",
    )
