"""Local backend: replicas are `modelyard worker` processes on this machine.

Each worker gets a free loopback port and its own log file, and is told to die with the
platform process (PR_SET_PDEATHSIG on Linux), so a crashed or killed `modelyard serve` leaves no
orphans (the worker arms that itself, see `worker.server`); a clean shutdown terminates them.

`detached=True` (the `controller` role): workers are not tied to the controller and outlive it,
stopping or dying, so that a standby that takes over adopts them (`adopt`: a replica another
process started, known by its pid) instead of restarting them. They exit on their own when no
controller heartbeats them for `owner_timeout_s` (`core/owner_watch.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from modelyard.control.backends.base import ReplicaHandle, ReplicaSpec, Waiting
from modelyard.core.cluster_auth import replica_env
from modelyard.core.load_progress import LOAD_PROGRESS_ENV, progress_file_beside
from modelyard.core.owner_watch import OWNER_TIMEOUT_ENV

log = logging.getLogger(__name__)

# The worker exits when the process named here dies (`worker.server.die_with_parent`). Spelled
# out rather than imported: importing the worker's server would load torch into the platform.
PARENT_PID_ENV = "MODELYARD_PARENT_PID"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# One long-lived thread forks every worker (see `LocalBackend.start`).
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-spawner")


def _spawn(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Its own process group: Ctrl-C in the terminal reaches `serve`, which then
            # drains and stops the workers in order instead of all dying at once.
            start_new_session=True,
        )


class LocalBackend:
    def __init__(
        self,
        log_dir: Path,
        host: str = "127.0.0.1",
        detached: bool = False,
        token: str | None = None,
        owner_timeout_s: float | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.host = host
        self.detached = detached
        self.token = token  # what the workers demand of callers (`core.cluster_auth`)
        # Detached workers exit when no owner heartbeats them this long (`core/owner_watch.py`).
        self.owner_timeout_s = owner_timeout_s if detached else None
        self._handles: dict[str, ReplicaHandle] = {}  # started or adopted, not stopped
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._adopted: dict[str, int] = {}  # replica id -> pid of a worker another process started
        log_dir.mkdir(parents=True, exist_ok=True)

    async def start(self, spec: ReplicaSpec, waiting: Waiting | None = None) -> ReplicaHandle:
        """`waiting` is never told anything: placement already found this machine's room."""
        port = free_port(self.host)
        # No --log-level: a replica logs as its platform does (its environment and TOML file).
        cmd = [sys.executable, "-m", "modelyard.cli", spec.command, "--host", self.host,
               "--port", str(port), *spec.args]  # fmt: skip
        if spec.command == "worker":
            cmd += ["--model", str(spec.model_path), "--served-model-name", spec.served_model_name]
        log_path = self.log_dir / f"{spec.replica_id}.log"
        env = replica_env(
            {
                **os.environ,
                **spec.engine_env,
                "PYTHONUNBUFFERED": "1",
                LOAD_PROGRESS_ENV: str(progress_file_beside(log_path)),
            },
            self.token,
        )
        env.pop(PARENT_PID_ENV, None)
        env.pop(OWNER_TIMEOUT_ENV, None)
        if not self.detached:
            env[PARENT_PID_ENV] = str(os.getpid())
        elif self.owner_timeout_s is not None:
            env[OWNER_TIMEOUT_ENV] = str(self.owner_timeout_s)
        # Spawned off the event loop (a fork and exec waits for the child's exec: half a
        # second on a loaded machine, a stall for every tenant) on the backend's one spawner
        # thread, which lives as long as the platform: the worker's parent-death signal is
        # tied to the thread that forked it.
        proc = await asyncio.get_running_loop().run_in_executor(
            _SPAWNER, _spawn, cmd, env, log_path
        )
        self._procs[spec.replica_id] = proc
        log.info("started replica %s (pid %d) on port %d", spec.replica_id, proc.pid, port)
        handle = ReplicaHandle(spec, f"http://{self.host}:{port}", proc.pid, log_path)
        self._handles[spec.replica_id] = handle
        return handle

    async def adopt(self, spec: ReplicaSpec, url: str, pid: int | None) -> ReplicaHandle:
        """A worker another controller started (it runs at `url` as `pid`) is this one's now."""
        if pid is not None:
            self._adopted[spec.replica_id] = pid
        handle = ReplicaHandle(spec, url, pid, self.log_dir / f"{spec.replica_id}.log")
        self._handles[spec.replica_id] = handle
        return handle

    def owned(self) -> list[ReplicaHandle]:
        return list(self._handles.values())

    def alive(self, handle: ReplicaHandle) -> bool:
        pid = self._adopted.get(handle.spec.replica_id)
        if pid is not None:
            return _worker_alive(pid)
        proc = self._procs.get(handle.spec.replica_id)
        return proc is not None and proc.poll() is None

    def exit_status(self, handle: ReplicaHandle) -> int | None:
        pid = self._adopted.get(handle.spec.replica_id)
        if pid is not None:  # not our child: its code is its parent's to read
            return None if _worker_alive(pid) else -1
        proc = self._procs.get(handle.spec.replica_id)
        return None if proc is None else proc.poll()

    def leaving(self) -> dict[str, float | None]:
        return {}  # this node's processes: nothing takes their node away ahead of time

    async def stop(self, handle: ReplicaHandle, timeout_s: float = 10.0) -> None:
        self._handles.pop(handle.spec.replica_id, None)
        pid = self._adopted.pop(handle.spec.replica_id, None)
        if pid is not None:
            await _stop_pid(handle.spec.replica_id, pid, timeout_s)
            return
        proc = self._procs.pop(handle.spec.replica_id, None)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("replica %s ignored SIGTERM; killing it", handle.spec.replica_id)
            proc.kill()
            await asyncio.to_thread(proc.wait)

    async def stop_all(self) -> None:
        procs = list(self._procs.items())
        self._procs.clear()
        adopted = list(self._adopted.items())
        self._adopted.clear()
        self._handles.clear()
        if self.detached:
            return  # they outlive this controller: the next leader adopts them
        for replica_id, pid in adopted:
            await _stop_pid(replica_id, pid, 10.0)
        for _, proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for replica_id, proc in procs:
            try:
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                log.warning("replica %s ignored SIGTERM; killing it", replica_id)
                proc.kill()


def _worker_alive(pid: int) -> bool:
    """`pid` runs and is a modelyard process (not a recycled pid of something else)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"modelyard" in f.read()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:  # no /proc (not Linux): the signal 0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


async def _stop_pid(replica_id: str, pid: int, timeout_s: float) -> None:
    """SIGTERM a worker this process did not start, SIGKILL it after `timeout_s`."""
    if not _worker_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while _worker_alive(pid):
        if asyncio.get_running_loop().time() > deadline:
            log.warning("replica %s ignored SIGTERM; killing it", replica_id)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return
        await asyncio.sleep(0.1)
