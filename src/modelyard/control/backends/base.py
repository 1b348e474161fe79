"""What the endpoint manager needs from a backend that runs worker replicas."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class ReplicaSpec:
    """What to run: an LLM `worker` for one model, or an `encoders` host (models added later)."""

    replica_id: str
    endpoint_id: str
    model_path: Path | None
    served_model_name: str
    engine_env: dict[str, str] = field(default_factory=dict)  # MODELYARD_* for the worker
    command: str = "worker"  # worker | encoders
    args: tuple[str, ...] = ()  # extra command-line options


@dataclass
class ReplicaHandle:
    spec: ReplicaSpec
    url: str
    pid: int | None
    log_path: Path | None = None


class Backend(Protocol):
    async def start(self, spec: ReplicaSpec) -> ReplicaHandle:
        """Launch the replica; returns once it is launched (not yet healthy)."""
        ...

    def alive(self, handle: ReplicaHandle) -> bool: ...

    def exit_status(self, handle: ReplicaHandle) -> int | None: ...

    async def stop(self, handle: ReplicaHandle, timeout_s: float = 10.0) -> None:
        """Ask the replica to exit (SIGTERM), kill it after `timeout_s`."""
        ...

    async def stop_all(self) -> None: ...
