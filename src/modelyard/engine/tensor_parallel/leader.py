"""Rank 0's side of a tensor-parallel group: `TensorParallelLeader` starts, feeds, watches and
stops the helper ranks (`helper.py`).

Failure handling: collectives run under a timeout (`wire.COLLECTIVE_TIMEOUT_S`); rank 0 sends a
heartbeat (a no-op header) when idle so that helpers waiting for the next step never hit it. A
helper that dies is seen by rank 0's monitor thread within half a second: the other helpers are
killed and `on_failure` runs (the worker exits). A dead rank 0 kills its helpers through
`PR_SET_PDEATHSIG` (armed by each helper; the helpers are spawned from the long-lived monitor
thread, since the signal follows the spawning thread), and a helper blocked in a collective sees
the closed connection at once.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # what torch.distributed re-exports

from modelyard.engine.attention import AttentionMetadata
from modelyard.engine.tensor_parallel.wire import (
    CMD_NOOP,
    CMD_STOP,
    COLLECTIVE_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    HelperSpec,
    TensorParallelError,
    backend_for,
    header,
    pack_step,
)

log = logging.getLogger("modelyard.engine.tensor_parallel")

HEARTBEAT_S = 5.0  # idle rank 0 pings the helpers this often
MONITOR_INTERVAL_S = 0.5
HELPER_MODULE = "modelyard.engine.tensor_parallel.helper"  # run with `python -m`


class TensorParallelLeader:
    """Rank 0's side of the group: starts, feeds, watches and stops the helper ranks.

    `start()` spawns the helpers and joins the process group; rank 0 then loads its own shard
    and calls `wait_ready()`. Each engine step runs inside `step()` (which holds the group's
    lock, so heartbeats never interleave with a step's collectives) and begins with
    `send_step()`. `close()` stops every rank; it is idempotent and also runs at exit.
    """

    def __init__(self, spec: HelperSpec, device: torch.device) -> None:
        self.spec = spec
        self.world_size = spec.world_size
        self.device = device
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self._store: TCPStore | None = None
        self._lock = threading.Lock()
        self._fail_lock = threading.Lock()
        self._closing = threading.Event()
        self._stop_monitor = threading.Event()
        self._spawned = threading.Event()
        self._spawn_error: BaseException | None = None
        self._monitor_thread: threading.Thread | None = None
        self._initialized = False
        self._ready = False
        self._closed = False
        self._last_op = time.monotonic()

    # ----- start ---------------------------------------------------------------------------

    def start(self) -> None:
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if dist.is_initialized():
            raise TensorParallelError(
                "torch.distributed is already initialised in this process: one tensor-parallel "
                "engine per process"
            )
        self._store = TCPStore(
            "127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False, timeout=timeout
        )
        atexit.register(self.close)
        # The helpers' PR_SET_PDEATHSIG fires when the *thread* that spawned them ends, so they
        # are spawned by the monitor thread, which lives until they are gone.
        self._monitor_thread = threading.Thread(
            target=self._monitor, name="tensor-parallel-monitor", daemon=True
        )
        self._monitor_thread.start()
        self._spawned.wait()
        if self._spawn_error is not None:
            raise TensorParallelError(f"could not start helper ranks: {self._spawn_error}")
        self._wait_keys([f"up/{r}" for r in range(1, self.world_size)], "start")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend_for(self.device),
            store=self._store,
            rank=0,
            world_size=self.world_size,
            timeout=timeout,
        )
        self._initialized = True
        log.info(
            "tensor parallel: %d ranks (%s), helper pids %s",
            self.world_size,
            backend_for(self.device),
            [p.pid for p in self.procs],
        )

    def wait_ready(self) -> None:
        """Wait until every helper has loaded its shard, then let them enter the step loop."""
        assert self._store is not None
        self._wait_keys([f"loaded/{r}" for r in range(1, self.world_size)], "load their shards")
        self._last_op = time.monotonic()
        self._store.set("go", "1")
        self._ready = True

    def _spawn(self) -> None:
        assert self._store is not None
        spec = json.dumps(asdict(self.spec))
        base_env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self._store.port),
            "WORLD_SIZE": str(self.world_size),
        }
        for rank in range(1, self.world_size):
            cmd = [sys.executable, "-m", HELPER_MODULE]
            cmd += ["--parent-pid", str(os.getpid()), "--spec", spec]
            env = {**base_env, "RANK": str(rank)}
            self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))

    def _wait_keys(self, keys: list[str], what: str) -> None:
        assert self._store is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._store.check(keys):
            if self.failure is not None:
                raise TensorParallelError(self.failure)
            if time.monotonic() > deadline:
                self.fail(f"helper ranks did not {what} within {STARTUP_TIMEOUT_S:g}s")
                raise TensorParallelError(self.failure or "")
            time.sleep(0.05)

    # ----- the monitor thread --------------------------------------------------------------

    def _monitor(self) -> None:
        try:
            self._spawn()
        except BaseException as exc:
            self._spawn_error = exc
            self._kill_helpers()
            return
        finally:
            self._spawned.set()
        while not self._stop_monitor.wait(MONITOR_INTERVAL_S):
            if self._closing.is_set() or self.failure is not None:
                continue
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None:
                    self.fail(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with {code}")
                    break
            else:
                self._heartbeat()

    def _heartbeat(self) -> None:
        if not self._ready or time.monotonic() - self._last_op < HEARTBEAT_S:
            return
        if not self._lock.acquire(blocking=False):
            return  # a step is running
        try:
            if not self._closing.is_set() and self.failure is None:
                self._broadcast_header(header(CMD_NOOP))
        except Exception as exc:
            self.fail(f"heartbeat to the helper ranks failed: {exc}")
        finally:
            self._lock.release()

    # ----- steps ---------------------------------------------------------------------------

    def _broadcast_header(self, values: list[int]) -> None:
        dist.broadcast(torch.tensor(values, dtype=torch.long, device=self.device), src=0)
        self._last_op = time.monotonic()

    @contextmanager
    def step(self) -> Iterator[None]:
        """Hold the group for one step; any error in it is fatal for the whole group."""
        with self._lock:
            if self.failure is not None:
                raise TensorParallelError(self.failure)
            if self._closing.is_set() or not self._ready:
                raise TensorParallelError("the tensor-parallel group is not running")
            try:
                yield
            except Exception as exc:
                self.fail(f"tensor-parallel step failed: {exc}")
                raise

    def send_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        values, payload = pack_step(input_ids, positions, meta)
        self._broadcast_header(values)
        dist.broadcast(payload, src=0)

    # ----- failure and shutdown ------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """Mark the group dead, kill every helper and tell `on_failure` (once)."""
        with self._fail_lock:
            if self.failure is not None or self._closing.is_set():
                return
            self.failure = reason
        log.error("%s; stopping every tensor-parallel rank", reason)
        self._kill_helpers()
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:
                log.exception("tensor-parallel on_failure callback failed")

    def _kill_helpers(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("helper rank pid %d did not die", proc.pid)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every helper (a STOP broadcast, then a kill after `timeout`) and leave the
        process group. Safe to call more than once, from any thread."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        atexit.unregister(self.close)
        locked = self._lock.acquire(timeout=timeout)
        try:
            if locked and self._ready and self.failure is None:
                try:
                    self._broadcast_header(header(CMD_STOP))
                except Exception as exc:
                    log.warning("could not tell the helper ranks to stop: %s", exc)
            deadline = time.monotonic() + timeout
            for proc in self.procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("helper rank pid %d did not stop; killing it", proc.pid)
            self._kill_helpers()
            if self._initialized:
                try:
                    dist.destroy_process_group()
                except Exception as exc:
                    log.warning("destroy_process_group failed: %s", exc)
                self._initialized = False
        finally:
            if locked:
                self._lock.release()
            self._stop_monitor.set()
            monitor = self._monitor_thread
            if monitor is not None and monitor is not threading.current_thread():
                monitor.join(timeout=5)
            self._store = None
