"""What the endpoint manager needs from a backend that runs worker replicas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

if TYPE_CHECKING:
    from modelyard.control.placement import Placement


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
    # What placement reserved, for a backend that asks a cluster scheduler for it (ray): the
    # version the node fetches from the artifact store, and the devices (kind, how many, bytes
    # of each). The local backend needs none of it: placement already chose this node's devices.
    version_id: str | None = None
    device_kind: str = "cpu"
    device_count: int = 1
    device_bytes: int = 0
    workload: str = "real-time"  # real-time | batch: which node classes it may use (ray nodes)


@dataclass
class ReplicaHandle:
    spec: ReplicaSpec
    url: str
    pid: int | None
    log_path: Path | None = None


# Told while a start waits for room the backend's scheduler has not got (Ray: no node has
# the resources free): why, in words for the endpoint's owner.
Waiting = Callable[[str], Awaitable[None]]


class Backend(Protocol):
    # Cluster mode: how long a replica waits for its owner's heartbeat before it exits
    # (`core/owner_watch.py`); None: its replicas have no watchdog (they die with `serve`).
    owner_timeout_s: float | None

    async def start(self, spec: ReplicaSpec, waiting: Waiting | None = None) -> ReplicaHandle:
        """Launch the replica; returns once it is launched (not yet healthy). `waiting` is
        told why, while the start waits for room (and again when the reason changes)."""
        ...

    def owned(self) -> list[ReplicaHandle]:
        """Every replica this backend started or adopted and has not stopped: the ones its
        owner heartbeats (`control/owner_heartbeat.py`)."""
        ...

    async def adopt(self, spec: ReplicaSpec, url: str, pid: int | None) -> ReplicaHandle:
        """Take over a replica another controller started and recorded (cluster mode: the new
        leader keeps it running); the handle's `alive`/`stop` work from here on. Async: finding
        it may ask a remote cluster (Ray), which never blocks the event loop."""
        ...

    def alive(self, handle: ReplicaHandle) -> bool: ...

    def exit_status(self, handle: ReplicaHandle) -> int | None: ...

    def leaving(self) -> dict[str, float | None]:
        """Replicas whose node is being taken away (Ray draining it: a spot notice), by replica
        id: when the node goes, in wall-clock seconds (None: no deadline given). What the
        backend last learnt: never blocks. The caller moves them (`ReplicaController`)."""
        ...

    async def stop(self, handle: ReplicaHandle, timeout_s: float = 10.0) -> None:
        """Ask the replica to exit (SIGTERM), kill it after `timeout_s`."""
        ...

    async def stop_all(self) -> None: ...


def placed_devices(placement: Placement, replica_id: str) -> dict[str, Any]:
    """`ReplicaSpec`'s device fields for a replica `placement` placed (none if it did not)."""
    request, devices = placement.request(replica_id), placement.assignment(replica_id)
    if request is None or not devices:
        return {}
    return {
        "device_kind": devices[0].kind,
        "device_count": len(devices),
        "device_bytes": request.memory_bytes,
    }


class ReplicaStartError(RuntimeError):
    """A replica exited or never answered its health check; the message has its log's tail."""


def log_tail(handle: ReplicaHandle, lines: int = 5) -> str:
    if handle.log_path is None or not handle.log_path.exists():
        return ""
    tail = handle.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
    return (": " + " | ".join(tail)) if tail else ""


async def wait_healthy(
    backend: Backend, handle: ReplicaHandle, http: httpx.AsyncClient, timeout_s: float
) -> None:
    """Until the replica's `/health` answers 200; raises if it exits or runs out of time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not backend.alive(handle):
            code = backend.exit_status(handle)
            raise ReplicaStartError(f"worker exited with code {code}{log_tail(handle)}")
        try:
            if (await http.get(handle.url + "/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.1)
    raise ReplicaStartError(f"worker not healthy after {timeout_s:g}s{log_tail(handle)}")
