"""Ray backend: each replica is a Ray actor on the node Ray's scheduler picks.

The platform's placement and autoscaling decide how many replicas an endpoint has and what each
needs; Ray decides which node runs it. A replica asks Ray for what placement reserved
(`ray_request`): a CPU core for its process, its GPUs (`num_gpus`) or, on a CPU device, its
memory budget (`memory`), and for a tensor-parallel replica one bundle per rank in a
`STRICT_PACK` placement group (its ranks are processes of one worker, so on one node). The actor
(`ray_host.ReplicaHost`) gets the model onto its node, starts the same `modelyard worker` the
local backend starts, on the node's address, and that address goes into the routing entry.

A replica's life is its actor's: the backend awaits the actor's `wait()` and learns of the
worker's exit (its code and log tail) or of the actor's death, which is how a lost node shows
(`alive` turns false at once; the endpoint manager then replaces the replica wherever Ray finds
room). `ray` is imported only when this backend is built.

With the elastic provider, the replicas on a node Ray is draining (a spot notice) are
`leaving`, with its deadline (`ray_nodes.tick_forever`); the endpoint's manager moves them
(`ReplicaController.leave_preempted`).

`detached=True` (the `controller` role): actors and placement groups outlive the controller that
made them (named `replica-<id>` in namespace `modelyard`), so a standby that takes over adopts
them; otherwise they belong to this process and die with it, leaving nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelyard.config import PlatformSettings
from modelyard.control.backends.base import (
    ReplicaHandle,
    ReplicaSpec,
    ReplicaStartError,
    Waiting,
)
from modelyard.control.backends.ray_host import ReplicaHost, Started
from modelyard.control.backends.ray_nodes import RayNodeProvider, tick_forever
from modelyard.control.backends.ray_request import ray_request, request_bundles
from modelyard.control.backends.ray_room import needs, wait_placed
from modelyard.control.node_provider import (
    NodeProvider,
    StaticNodeProvider,
    Workload,
    preference,
)
from modelyard.control.registry import Registry, ResolvedVersion
from modelyard.core.cluster_auth import WORKER_TOKEN_ENV, replica_token
from modelyard.core.owner_watch import OWNER_TIMEOUT_ENV, owner_timeout_s

log = logging.getLogger(__name__)

NAMESPACE = "modelyard"
# Exit code reported for a replica whose actor died under it (node lost, actor killed): the
# worker was killed with it (SIGKILL, see `ray_host`).
LOST_EXIT_CODE = -9
# The longest the backend waits for a replica's actor to say where it runs.
_ASK_ACTOR_S = 10.0


def actor_name(replica_id: str) -> str:
    return f"replica-{replica_id}"


class RankHolder:
    """Holds one rank's bundle of a tensor-parallel replica and says which GPUs Ray gave it."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


@dataclass
class _Running:
    host: Any  # the ReplicaHost actor handle
    group: Any = None  # its placement group (tensor parallel)
    holders: list[Any] = field(default_factory=list)
    watch: asyncio.Task[None] | None = None
    exit: int | None = None
    node_id: str | None = None  # the Ray node its worker runs on (hex)


class RayBackend:
    def __init__(
        self,
        settings: PlatformSettings,
        log_dir: Path,
        registry: Registry | None = None,
        detached: bool = False,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.log_dir = log_dir
        self.detached = detached
        # Detached replicas exit when no owner heartbeats them this long (`core/owner_watch`).
        self.owner_timeout_s = owner_timeout_s(settings) if detached else None
        self._running: dict[str, _Running] = {}
        self._handles: dict[str, ReplicaHandle] = {}  # started or adopted, not stopped
        self._remote: tuple[Any, Any] | None = None  # ray.remote(ReplicaHost), (RankHolder)
        self._connecting = threading.Lock()
        # Where nodes come from (`control/node_provider.py`); the elastic one is ticked while
        # this backend runs replicas.
        self.nodes: NodeProvider = (
            RayNodeProvider(settings) if settings.node_provider == "ray" else StaticNodeProvider()
        )
        self._ticker: asyncio.Task[None] | None = None
        self._leaving: dict[str, float | None] = {}  # `leaving`, as of the provider's last tick
        log_dir.mkdir(parents=True, exist_ok=True)

    # -- Ray ----------------------------------------------------------------------------------

    def _connect(self) -> tuple[Any, Any]:
        """Join the cluster (once: replicas start concurrently) and wrap the actor classes."""
        with self._connecting:
            return self._connect_once()

    def _connect_once(self) -> tuple[Any, Any]:
        if self._remote is None:
            import ray

            if not ray.is_initialized():
                # The platform is a Ray driver; the workers' output stays in their node's logs.
                ray.init(
                    address=self.settings.ray_address,
                    namespace=NAMESPACE,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                )
            self._remote = (ray.remote(ReplicaHost), ray.remote(RankHolder))
        return self._remote

    def _with_token(self, spec: ReplicaSpec) -> ReplicaSpec:
        """The spec whose worker demands the cluster's token: on a node's address, anyone on
        that network could otherwise call it (`core.cluster_auth`); and, detached, exits when
        no owner heartbeats it (`core/owner_watch.py`)."""
        env = {k: v for k, v in spec.engine_env.items() if k != OWNER_TIMEOUT_ENV}
        token = replica_token(self.settings)
        if token is not None:
            env[WORKER_TOKEN_ENV] = token
        if self.owner_timeout_s is not None:
            env[OWNER_TIMEOUT_ENV] = str(self.owner_timeout_s)
        return dataclasses.replace(spec, engine_env=env)

    def _store(self) -> dict[str, Any]:
        """How a node reaches the artifact store (never credentials: the node's own chain)."""
        s = self.settings
        keys = ("artifact_store", "s3_bucket", "s3_prefix", "s3_endpoint_url", "s3_region")
        return {
            "settings": {k: getattr(s, k) for k in keys} | {"node_cache_bytes": s.node_cache_bytes},
            "local_root": str((s.data_dir / "artifacts").resolve()),
        }

    def _version(self, version_id: str) -> ResolvedVersion:
        """The version's files (what a node's cache fetches), from the registry."""
        if self.registry is None:  # built apart from a platform (the controller role)
            from modelyard.store.artifact_store import open_artifact_store
            from modelyard.store.artifacts import ArtifactStore
            from modelyard.store.db import Database

            local = ArtifactStore(self.settings.data_dir / "artifacts")
            self.registry = Registry(
                Database(self.settings.resolved_database_url),
                open_artifact_store(self.settings, local),
            )
        return self.registry.by_id(version_id)

    # -- Backend ------------------------------------------------------------------------------

    async def start(self, spec: ReplicaSpec, waiting: Waiting | None = None) -> ReplicaHandle:
        """`waiting` is told why while Ray has no node with room for the replica (and the start
        goes on waiting for room, up to `replica_start_timeout_s`)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        host_cls, holder_cls = await asyncio.to_thread(self._connect)
        self._start_ticking()
        request = ray_request(spec)
        choice = await asyncio.to_thread(
            self.nodes.choose, Workload(spec.workload), needs(request.actor, request.bundles)
        )
        request = ray_request(spec, choice.node_class)
        bundles = request_bundles(request)
        if not choice.room:  # no node of its class has room: ask for one
            await asyncio.to_thread(self.nodes.request, spec.replica_id, bundles, choice.node_class)
        lifetime = "detached" if self.detached else None
        running = _Running(host=None)
        name = actor_name(spec.replica_id)
        options: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "lifetime": lifetime}
        timeout = self.settings.replica_start_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            if request.bundles:
                running.group = await asyncio.to_thread(
                    ray.util.placement_group,
                    request.bundles, strategy="STRICT_PACK", name=name, lifetime=lifetime,
                )  # fmt: skip
                ready = running.group.ready()
                await wait_placed(ready, request.actor, request.bundles, deadline, waiting)
                for i in range(1, len(request.bundles)):
                    strategy = PlacementGroupSchedulingStrategy(running.group, i)
                    holder = await asyncio.to_thread(
                        holder_cls.options(
                            scheduling_strategy=strategy, lifetime=lifetime, **request.actor
                        ).remote
                    )
                    running.holders.append(holder)
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(running.group, 0)
            else:
                # Replicas spread over nodes: losing one node loses as few replicas as it can.
                options["scheduling_strategy"] = "SPREAD"
            # A named actor is registered with Ray's control store before `remote()` returns.
            create = host_cls.options(**options, **request.actor).remote
            running.host = await asyncio.to_thread(create)
            await wait_placed(
                running.host.placed.remote(), request.actor, request.bundles, deadline, waiting
            )
            await asyncio.to_thread(self.nodes.held, spec.replica_id, bundles)
            version = None
            if spec.version_id is not None:
                version = await asyncio.to_thread(self._version, spec.version_id)
            gpus = [g for h in running.holders for g in await h.gpu_ids.remote()]
            left = max(1.0, deadline - asyncio.get_running_loop().time())
            started: Started = await asyncio.wait_for(
                running.host.start.remote(self._with_token(spec), version, self._store(), gpus),
                left,
            )
        except BaseException as exc:
            await asyncio.shield(self._release(running))
            await asyncio.shield(asyncio.to_thread(self.nodes.forget, spec.replica_id))
            if isinstance(exc, TimeoutError):
                why = f"Ray found no node with room for {request.actor} within {timeout:g}s"
                raise ReplicaStartError(why) from exc
            if isinstance(exc, ray.exceptions.RayError):
                raise ReplicaStartError(f"its Ray actor failed: {_first_line(exc)}") from exc
            raise
        return self._track(spec, running, started)

    def _track(self, spec: ReplicaSpec, running: _Running, started: Started) -> ReplicaHandle:
        replica_id = spec.replica_id
        running.node_id = started.node_id
        self._running[replica_id] = running
        log_path = self.log_dir / f"{replica_id}.log"
        self._note(log_path, f"on Ray node {started.node_id} at {started.url} (pid {started.pid})")
        running.watch = asyncio.create_task(self._watch(replica_id, running, log_path))
        log.info("started replica %s on Ray node %s at %s", replica_id, started.node_id[:12],
                 started.url)  # fmt: skip
        handle = ReplicaHandle(spec, started.url, started.pid, log_path)
        self._handles[replica_id] = handle
        return handle

    async def _watch(self, replica_id: str, running: _Running, log_path: Path) -> None:
        """Until the worker exits or the actor dies; records which, for `exit_status`."""
        import ray

        try:
            code, tail = await running.host.wait.remote()
            running.exit = code
            self._note(log_path, f"worker exited with code {code}: {tail}")
        except ray.exceptions.RayError as exc:  # the actor died: node lost, actor killed
            running.exit = LOST_EXIT_CODE
            why = _first_line(exc) if "node" not in str(exc) else "its Ray node died"
            self._note(log_path, f"replica lost: {why}")
            log.warning("replica %s lost: %s", replica_id, why)
        await asyncio.to_thread(self.nodes.forget, replica_id)  # its room is gone either way

    @staticmethod
    def _note(log_path: Path, line: str) -> None:
        # The platform's copy of what matters in the node's log (`log_tail` reads it).
        with open(log_path, "a") as f:
            f.write(line + "\n")

    async def adopt(self, spec: ReplicaSpec, url: str, pid: int | None) -> ReplicaHandle:
        """A replica another controller started: its actor, found by name, is watched from here
        on (a name Ray no longer knows is a replica that is gone). Joining Ray and looking the
        actor up are blocking calls to Ray's control store: on a thread, never on the loop."""
        running = await asyncio.to_thread(self._find, spec.replica_id)
        self._running[spec.replica_id] = running
        log_path = self.log_dir / f"{spec.replica_id}.log"
        if running.host is not None:
            self._start_ticking()
            # Held in the class its workload prefers first (the one it most likely runs on).
            first = preference(Workload(spec.workload), self.settings.spot_policy)[0]
            bundles = request_bundles(ray_request(spec, first))
            await asyncio.to_thread(self.nodes.held, spec.replica_id, bundles)
            with contextlib.suppress(Exception):  # where it runs: for `leaving`
                where = await asyncio.wait_for(running.host.where.remote(), _ASK_ACTOR_S)
                running.node_id = None if where is None else where.node_id
            running.watch = asyncio.get_running_loop().create_task(
                self._watch(spec.replica_id, running, log_path)
            )
        handle = ReplicaHandle(spec, url, pid, log_path)
        self._handles[spec.replica_id] = handle
        return handle

    def owned(self) -> list[ReplicaHandle]:
        return list(self._handles.values())

    def _find(self, replica_id: str) -> _Running:
        """The named actor and placement group of a running replica (blocking: a thread's)."""
        import ray

        self._connect()
        running = _Running(host=None)
        try:
            running.host = ray.get_actor(actor_name(replica_id), namespace=NAMESPACE)
        except ValueError:
            running.exit = LOST_EXIT_CODE
        with contextlib.suppress(ValueError):
            running.group = ray.util.get_placement_group(actor_name(replica_id))
        return running

    def alive(self, handle: ReplicaHandle) -> bool:
        running = self._running.get(handle.spec.replica_id)
        return running is not None and running.exit is None

    def exit_status(self, handle: ReplicaHandle) -> int | None:
        running = self._running.get(handle.spec.replica_id)
        return LOST_EXIT_CODE if running is None else running.exit

    def leaving(self) -> dict[str, float | None]:
        return dict(self._leaving)

    async def stop(self, handle: ReplicaHandle, timeout_s: float = 10.0) -> None:
        """The worker drains on SIGTERM (SIGKILL after `timeout_s`), then its actor goes (and
        its placement group): also for a replica whose worker already exited."""
        self._handles.pop(handle.spec.replica_id, None)
        running = self._running.pop(handle.spec.replica_id, None)
        await asyncio.to_thread(self.nodes.forget, handle.spec.replica_id)
        if running is None:
            return
        if running.host is not None and running.exit is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(running.host.stop.remote(timeout_s), timeout_s + 5.0)
        await self._release(running)

    async def _release(self, running: _Running) -> None:
        """Kill the actors and remove the placement group (nothing of the replica stays)."""
        if running.watch is not None:
            running.watch.cancel()
        await asyncio.to_thread(_kill, running)

    def _start_ticking(self) -> None:
        """The elastic provider's release loop, once (it lives as long as this backend)."""
        if isinstance(self.nodes, RayNodeProvider) and self._ticker is None:
            ticks = tick_forever(self.nodes, self._where, self._leaving)
            self._ticker = asyncio.get_running_loop().create_task(ticks)

    def _where(self) -> dict[str, str | None]:
        """The node each running replica is on (for `leaving`)."""
        return {i: r.node_id for i, r in list(self._running.items()) if r.exit is None}

    async def stop_all(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        running = list(self._running.values())
        self._running.clear()
        self._handles.clear()
        if self.detached:  # they outlive this controller: the next leader adopts them
            for r in running:
                if r.watch is not None:
                    r.watch.cancel()
            return
        handles = [r for r in running if r.host is not None and r.exit is None]
        await asyncio.gather(
            *(asyncio.wait_for(r.host.stop.remote(10.0), 15.0) for r in handles),
            return_exceptions=True,
        )
        for r in running:
            await self._release(r)


def _kill(running: _Running) -> None:
    """Blocking calls to Ray's control store (a thread's)."""
    import ray

    for actor in [running.host, *running.holders]:
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
    if running.group is not None:
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(running.group)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
