"""Local backend: replicas are `modelyard worker` processes on this machine.

Each worker gets a free loopback port and its own log file, and is told to die with the
platform process (PR_SET_PDEATHSIG on Linux), so a crashed or killed `modelyard serve` leaves no
orphans (the worker arms that itself, see `worker.server`); a clean shutdown terminates them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

from modelyard.control.backends.base import ReplicaHandle, ReplicaSpec

log = logging.getLogger(__name__)

# The worker exits when the process named here dies (`worker.server.die_with_parent`). Spelled
# out rather than imported: importing the worker's server would load torch into the platform.
PARENT_PID_ENV = "MODELYARD_PARENT_PID"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalBackend:
    def __init__(self, log_dir: Path, host: str = "127.0.0.1") -> None:
        self.log_dir = log_dir
        self.host = host
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    async def start(self, spec: ReplicaSpec) -> ReplicaHandle:
        port = free_port(self.host)
        cmd = [sys.executable, "-m", "modelyard.cli", spec.command, "--host", self.host,
               "--port", str(port), "--log-level", "warning", *spec.args]  # fmt: skip
        if spec.command == "worker":
            cmd += ["--model", str(spec.model_path), "--served-model-name", spec.served_model_name]
        log_path = self.log_dir / f"{spec.replica_id}.log"
        env = {
            **os.environ,
            **spec.engine_env,
            "PYTHONUNBUFFERED": "1",
            PARENT_PID_ENV: str(os.getpid()),
        }
        # Spawned from the event-loop thread on purpose: the worker's parent-death signal is
        # tied to the thread that forked it, and this one lives as long as the platform.
        with open(log_path, "ab") as log_file:  # noqa: ASYNC230
            proc = subprocess.Popen(  # noqa: ASYNC220
                cmd,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Its own process group: Ctrl-C in the terminal reaches `serve`, which then
                # drains and stops the workers in order instead of all dying at once.
                start_new_session=True,
            )
        self._procs[spec.replica_id] = proc
        log.info("started replica %s (pid %d) on port %d", spec.replica_id, proc.pid, port)
        return ReplicaHandle(spec, f"http://{self.host}:{port}", proc.pid, log_path)

    def alive(self, handle: ReplicaHandle) -> bool:
        proc = self._procs.get(handle.spec.replica_id)
        return proc is not None and proc.poll() is None

    def exit_status(self, handle: ReplicaHandle) -> int | None:
        proc = self._procs.get(handle.spec.replica_id)
        return None if proc is None else proc.poll()

    async def stop(self, handle: ReplicaHandle, timeout_s: float = 10.0) -> None:
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
        for _, proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for replica_id, proc in procs:
            try:
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                log.warning("replica %s ignored SIGTERM; killing it", replica_id)
                proc.kill()
