"""The Ray actor that runs one replica on its node: fetch the model, start the worker, watch it.

The platform's ray backend (`control/backends/ray.py`) creates one `ReplicaHost` actor per
replica, where Ray's scheduler found the resources placement asked for. The actor makes sure the
node has the model files (a path the node already sees, else its own node cache, copied from the
artifact store and hash-verified), starts `modelyard worker` on the node's address exactly as the
local backend does on its machine, and answers the backend's questions about that process.

The worker is tied to the actor with a parent-death signal of SIGKILL, armed by the forking
thread: the actor's event loop thread, which lives as long as the actor. So when Ray loses the
actor (its node died or was removed, the actor was killed) the worker dies at once too, as it
would with its node: the platform sees one failure, never a worker serving on without an owner.
The other way round, a worker that exits because no controller heartbeated it
(`core/owner_watch.py`, exit code 4) takes its actor and placement group with it: a detached
actor outlives every controller, and nobody would be left to remove it.

Plain Python, no `ray` import at module level: the backend wraps the class with `ray.remote`.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelyard.control.backends.base import ReplicaSpec
from modelyard.control.backends.local import PARENT_PID_ENV, free_port
from modelyard.core.cluster_auth import WORKER_TOKEN_ENV, replica_env
from modelyard.core.owner_watch import ORPHANED_EXIT_CODE

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_TAIL_LINES = 5


@dataclass(frozen=True)
class Started:
    """Where the replica serves and on which Ray node (the backend's routing address)."""

    url: str
    pid: int
    node_id: str
    node_ip: str


def _die_with_parent_thread() -> None:
    # Runs in the child between fork and exec; the flag survives exec (no set-uid binary).
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def node_dir() -> Path:
    """This node's modelyard folder (logs, node cache): its own `MODELYARD_DATA_DIR` when Ray's
    workers there were started with one, else a folder under the node's temporary directory."""
    configured = os.environ.get("MODELYARD_DATA_DIR")
    root = Path(configured) if configured else Path(tempfile.gettempdir()) / "modelyard-node"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


class ReplicaHost:
    """One replica's worker process on the node this actor was scheduled on."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.started: Started | None = None
        self._reaper: asyncio.Task[None] | None = None

    async def placed(self) -> bool:
        """Answers once Ray has placed this actor (the backend waits for room until then)."""
        return True

    def _model_path(self, spec: ReplicaSpec, version: Any, store: dict[str, Any]) -> Path | None:
        """The model files on this node: the platform's path if the node sees it (one machine,
        or a shared file system), else this node's cache filled from the artifact store."""
        if spec.model_path is None or spec.model_path.exists() or version is None:
            return spec.model_path
        from modelyard.config import PlatformSettings
        from modelyard.control.node_cache import NodeCache
        from modelyard.store.artifact_store import open_artifact_store
        from modelyard.store.artifacts import ArtifactStore

        settings = PlatformSettings(**store["settings"])
        blobs = open_artifact_store(settings, ArtifactStore(Path(store["local_root"])))
        cache = NodeCache(node_dir() / "node-cache", blobs, settings.node_cache_bytes)
        return cache.fetch(version).path

    async def start(
        self, spec: ReplicaSpec, version: Any, store: dict[str, Any], rank_gpus: list[str]
    ) -> Started:
        """Start the worker (the model fetched first if need be); returns once it runs.
        `rank_gpus`: the GPUs Ray gave the other ranks of a tensor-parallel replica."""
        import ray

        path = await asyncio.to_thread(self._model_path, spec, version, store)
        host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        port = free_port(host)
        cmd = [sys.executable, "-m", "modelyard.cli", spec.command, "--host", host,
               "--port", str(port), *spec.args]  # fmt: skip
        if spec.command == "worker":
            cmd += ["--model", str(path), "--served-model-name", spec.served_model_name]
        # The token the platform gave (in engine_env); never a secret the node's env holds.
        token = spec.engine_env.get(WORKER_TOKEN_ENV)
        env = replica_env({**os.environ, **spec.engine_env, "PYTHONUNBUFFERED": "1"}, token)
        # Tied to this actor by SIGKILL below, not to a platform process by SIGTERM.
        env.pop(PARENT_PID_ENV, None)
        engine_cache = Path(env.get("MODELYARD_CACHE_DIR", ""))
        if not engine_cache.is_absolute() or not engine_cache.parent.exists():
            env["MODELYARD_CACHE_DIR"] = str(node_dir() / "node-cache" / "engine")
        gpus = [str(i) for i in ray.get_gpu_ids()] + rank_gpus
        if gpus:
            # Ray chose this node's GPUs; the platform's own device numbers mean nothing here.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        self.log_path = node_dir() / "logs" / f"{spec.replica_id}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:  # noqa: ASYNC230
            self.proc = subprocess.Popen(  # noqa: ASYNC220
                cmd,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent_thread,  # only a prctl: safe after fork
            )
        node_id = ray.get_runtime_context().get_node_id()
        log.info("replica %s: pid %d at %s:%d", spec.replica_id, self.proc.pid, host, port)
        self.started = Started(f"http://{host}:{port}", self.proc.pid, node_id, host)
        self._reaper = asyncio.create_task(self._leave_when_orphaned(spec.replica_id))
        return self.started

    async def _leave_when_orphaned(self, replica_id: str) -> None:
        """The worker exited for want of an owner: remove this actor and its placement group
        (a tensor-parallel replica's), which nothing else would."""
        import ray

        code, _ = await self.wait()
        if code != ORPHANED_EXIT_CODE:
            return  # its controller saw it exit and removes the actor
        log.warning("replica %s: no controller owns it any more; its actor leaves", replica_id)
        try:
            group = ray.util.get_placement_group(f"replica-{replica_id}")
        except ValueError:
            group = None
        if group is not None:
            ray.util.remove_placement_group(group)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def wait(self) -> tuple[int, str]:
        """Returns when the worker exits: its exit code and the tail of its log."""
        # Polled: a child's exit has no event to await without parking a thread per replica.
        while self.proc is None or self.proc.poll() is None:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        return int(self.proc.returncode), self.tail()

    def tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").strip().splitlines()[-_TAIL_LINES:]
        return " | ".join(lines)

    async def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (the worker drains and exits), SIGKILL after `timeout_s`."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.terminate()
        try:
            return await asyncio.to_thread(proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return await asyncio.to_thread(proc.wait)

    async def where(self) -> Started | None:
        """`start`'s answer again while the worker runs, for a controller that adopts it."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        return self.started
