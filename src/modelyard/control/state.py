"""What the control plane knows of each endpoint and its replicas, between reconcile ticks."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import ValidationError

from modelyard.config import EngineSettings
from modelyard.control.autoscaler import Autoscaler, Decision
from modelyard.control.backends.base import ReplicaHandle
from modelyard.control.scaling import LoadTracker
from modelyard.core.errors import Invalid
from modelyard.core.routing import EndpointRoute, ReplicaRoute
from modelyard.core.status import LIVE, EndpointStatus, ReplicaState, StatusTrigger
from modelyard.store.tables import Endpoint


@dataclass(eq=False)
class Replica:
    replica_id: str
    route: ReplicaRoute | None = None
    handle: ReplicaHandle | None = None
    state: ReplicaState = ReplicaState.STARTING
    started_at: float = field(default_factory=time.time)
    ready_after_s: float | None = None
    health_failures: int = 0
    error: str | None = None
    load: dict[str, Any] | None = None  # its last /health report
    placement_id: str | None = None  # its allocation in the node's `Placement`
    version_id: str | None = None  # the model version it runs
    devices: list[str] = field(default_factory=list)
    preempted: bool = False  # its node is being taken away: it drains, a replacement starts

    def view(self) -> dict[str, Any]:
        return {
            "id": self.replica_id,
            "state": self.state,
            "address": self.handle.url if self.handle else None,
            "pid": self.handle.pid if self.handle else None,
            "started_at": int(self.started_at),
            "ready_after_s": None if self.ready_after_s is None else round(self.ready_after_s, 2),
            "outstanding": self.route.outstanding if self.route else 0,
            "devices": self.devices,
            "version_id": self.version_id,
            "error": self.error,
        }


class VersionRef(NamedTuple):
    version_id: str | None  # None: a server folder, not a registry version
    artifact: str  # NAME:VERSION, or the folder


@dataclass(eq=False)
class EndpointState:
    row: Endpoint
    route: EndpointRoute
    model_path: Path | None = None
    engine_env: dict[str, str] = field(default_factory=dict)
    engine: EngineSettings = field(default_factory=EngineSettings)  # effective, for sizing
    replicas: list[Replica] = field(default_factory=list)
    desired: int = 1
    restarts: int = 0
    failures: int = 0  # replica failures since one was last ready: the restart backoff
    failed_devices: set[str] = field(default_factory=set)  # where loads failed since then
    next_restart_at: float = 0.0
    status: EndpointStatus = EndpointStatus.PROVISIONING
    trigger: StatusTrigger = StatusTrigger.DEPLOYED  # what caused the last status change
    message: str | None = None
    last_error: str | None = None
    kind: str | None = None  # llm, or an encoder kind served by the shared encoder host
    last_fetch: str | None = None  # where the replica came from: warm pool, node cache, store
    requests_seen: int = 0  # the gateway's count at the last tick, for the traffic history
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    autoscaler: Autoscaler | None = None
    load: LoadTracker | None = None
    decisions: deque[Decision] = field(default_factory=lambda: deque(maxlen=20))

    # The version a rollout in progress moves the endpoint to (`control/versions.py`: its
    # canary at 100 %); the row's version serves until it is promoted.
    rollout_to: VersionRef | None = None

    def clear_failures(self) -> None:
        """A replica served, or the version changed: no backoff, every device is a candidate."""
        self.failures = 0
        self.failed_devices.clear()

    @property
    def target(self) -> VersionRef:
        """The version the endpoint was asked to run: a rollout's while one runs."""
        return self.rollout_to or VersionRef(self.row.version_id, self.row.artifact)

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.state in LIVE]

    @property
    def serving(self) -> int:
        """Replicas in routing (any version)."""
        return sum(r.state is ReplicaState.READY for r in self.replicas)

    @property
    def current(self) -> list[Replica]:
        """Live replicas of the version the endpoint should run."""
        return [r for r in self.live if r.version_id == self.row.version_id]


# The longest value an engine option may have (paths, device names).
ENGINE_OPTION_CHARS = 4096


def engine_env(options: dict[str, Any]) -> tuple[dict[str, str], EngineSettings]:
    """Validate engine options against `EngineSettings` and turn them into worker env vars."""
    unknown = sorted(set(options) - set(EngineSettings.model_fields))
    if unknown:
        raise Invalid(f"unknown engine option(s): {', '.join(unknown)}", param="engine")
    try:
        settings = EngineSettings(**options)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        param = f"engine.{where}" if where else "engine"
        raise Invalid(f"{param}: {first['msg']}", param=param) from exc
    env = {f"MODELYARD_{k.upper()}": str(v) for k, v in options.items()}
    for name, value in env.items():  # an environment string has limits of its own (execve)
        if len(value) > ENGINE_OPTION_CHARS:
            option = name.removeprefix("MODELYARD_").lower()
            raise Invalid(
                f"engine.{option}: at most {ENGINE_OPTION_CHARS} characters",
                param=f"engine.{option}",
            )
    return env, settings


def spawn(state: EndpointState, coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` as a task of the endpoint (cancelled with it)."""
    task = asyncio.create_task(coro)
    state.tasks.add(task)
    task.add_done_callback(state.tasks.discard)
