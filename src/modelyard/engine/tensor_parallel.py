"""Tensor parallelism: one model spread over several ranks (processes, one per device) of a node.

Rank 0 is the ordinary engine process: scheduler, KV cache manager, sampler, detokenizer and
whatever serves it. `TensorParallelLeader` starts ranks 1..N-1 as helper processes
(`python -m modelyard.engine.tensor_parallel`), watches them, and before every forward pass
broadcasts the step's inputs. Helpers load only their shard of the weights (see
`models/sharding.py`), keep a KV cache for only their KV heads, and run the same forward pass;
only rank 0 computes logits.

Per step the wire format is two broadcasts of int64 tensors, no pickling:

- a fixed header of `HEADER_LEN` values: command, payload length, T (tokens), decodes,
  decode block-table width, prefill chunks;
- the payload: token ids [T], positions [T], slot mapping [T], the decodes' padded block tables
  [decodes * width], one (start, end, num_computed, n_context_blocks) row per prefill chunk,
  then the chunks' context block ids. The decode mask is rebuilt from the positions.

Failure handling: collectives run under a timeout (`COLLECTIVE_TIMEOUT_S`); rank 0 sends a
heartbeat (a no-op header) when idle so that helpers waiting for the next step never hit it. A
helper that dies is seen by rank 0's monitor thread within half a second: the other helpers are
killed and `on_failure` runs (the worker exits). A dead rank 0 kills its helpers through
`PR_SET_PDEATHSIG` (armed by each helper; the helpers are spawned from the long-lived monitor
thread, since the signal follows the spawning thread), and a helper blocked in a collective sees
the closed connection at once.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from modelyard.engine.attention import AttentionMetadata, PrefillChunk

if TYPE_CHECKING:
    from modelyard.engine.model_runner import ModelRunner, StepInputs

log = logging.getLogger("modelyard.engine.tensor_parallel")  # also when run as __main__

HEADER_LEN = 8
CMD_STEP, CMD_NOOP, CMD_STOP = 1, 2, 3
COLLECTIVE_TIMEOUT_S = 120.0  # any one broadcast / all-reduce
STARTUP_TIMEOUT_S = 900.0  # helpers loading their shards
HEARTBEAT_S = 5.0  # idle rank 0 pings the helpers this often
MONITOR_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1


class TensorParallelError(RuntimeError):
    """A rank died, timed out or failed; the tensor-parallel group cannot go on."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a replica on `cuda:K` (or `cuda`) runs on `cuda:K+r`; CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(tp_size: int) -> int:
    """CPU ranks split the cores this process may use between them."""
    return max(1, usable_cores() // tp_size)


# ----- the step on the wire --------------------------------------------------------------------


def _header(cmd: int, *values: int) -> list[int]:
    return [cmd, *values] + [0] * (HEADER_LEN - 1 - len(values))


def encode_step(inputs: StepInputs) -> tuple[list[int], torch.Tensor]:
    """The header values and the int64 payload (on the inputs' device) of one step."""
    meta = inputs.meta
    device = inputs.input_ids.device
    parts = [inputs.input_ids, inputs.positions, meta.slot_mapping]
    width = 0
    if meta.num_decodes:
        assert meta.decode_block_tables is not None
        width = meta.decode_block_tables.shape[1]
        parts.append(meta.decode_block_tables.reshape(-1))
    rows: list[int] = []
    for chunk in meta.prefills:
        n_ctx = 0 if chunk.context_blocks is None else chunk.context_blocks.numel()
        rows += [chunk.start, chunk.end, chunk.num_computed, n_ctx]
    parts.append(torch.tensor(rows, dtype=torch.long).to(device))
    parts.extend(c.context_blocks for c in meta.prefills if c.context_blocks is not None)
    payload = torch.cat(parts)
    header = _header(
        CMD_STEP,
        payload.numel(),
        inputs.input_ids.numel(),
        meta.num_decodes,
        width,
        len(meta.prefills),
    )
    return header, payload


def decode_step(
    header: list[int], payload: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Token ids, positions and attention metadata rebuilt from `encode_step`'s output."""
    _, _, t, nd, width, n_chunks = header[:6]
    input_ids, positions, slots = payload[:t], payload[t : 2 * t], payload[2 * t : 3 * t]
    off = 3 * t
    tables = mask = None
    if nd:
        tables = payload[off : off + nd * width].view(nd, width)
        off += nd * width
        padded = width * block_size
        lengths = positions[:nd] + 1  # a decode's token sits at position length - 1
        mask = torch.arange(padded, device=payload.device) < lengths.unsqueeze(1)
        mask = mask.view(nd, 1, 1, padded)
    rows = payload[off : off + 4 * n_chunks].view(n_chunks, 4).tolist()
    off += 4 * n_chunks
    chunks: list[PrefillChunk] = []
    for start, end, num_computed, n_ctx in rows:
        blocks = payload[off : off + n_ctx] if n_ctx else None
        off += n_ctx
        chunks.append(PrefillChunk(start, end, num_computed, blocks))
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_size=block_size,
        num_decodes=nd,
        decode_block_tables=tables,
        decode_mask=mask,
        prefills=chunks,
    )
    return input_ids, positions, meta


# ----- rank 0 ----------------------------------------------------------------------------------


@dataclass
class HelperSpec:
    """What a helper rank needs to build its part of the engine, decided by rank 0."""

    folder: str
    dtype: str  # "float32" | "bfloat16"
    kv_dtype: str  # the KV cache's, "float32" | "bfloat16"
    device: str  # rank 0's base device; rank r uses `rank_device(device, r)`
    max_model_len: int
    num_blocks: int
    block_size: int
    num_threads: int | None
    world_size: int
    log_level: int = logging.INFO


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
        self._store: dist.TCPStore | None = None
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
        self._store = dist.TCPStore(
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
            cmd = [sys.executable, "-m", "modelyard.engine.tensor_parallel"]
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
                self._broadcast_header(_header(CMD_NOOP))
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

    def send_step(self, inputs: StepInputs) -> None:
        header, payload = encode_step(inputs)
        self._broadcast_header(header)
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
                    self._broadcast_header(_header(CMD_STOP))
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


# ----- helper ranks ----------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this helper when rank 0's spawning thread dies; exit if it already has."""
    if sys.platform.startswith("linux"):
        with suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        sys.exit(1)


def serve_steps(runner: ModelRunner) -> int:
    """Run rank 0's steps until it says stop; returns how many steps ran."""
    device = runner.device
    steps = 0
    with torch.inference_mode():
        header = torch.empty(HEADER_LEN, dtype=torch.long, device=device)
        while True:
            dist.broadcast(header, src=0)
            values = header.tolist()
            cmd = values[0]
            if cmd == CMD_STOP:
                return steps
            if cmd == CMD_NOOP:
                continue
            if cmd != CMD_STEP:
                raise TensorParallelError(f"unknown command {cmd} from rank 0")
            payload = torch.empty(values[1], dtype=torch.long, device=device)
            dist.broadcast(payload, src=0)
            input_ids, positions, meta = decode_step(values, payload, runner.block_size)
            runner.forward(input_ids, positions, meta)
            steps += 1


def run_helper(spec: HelperSpec, rank: int, master_port: int) -> None:
    from modelyard.engine.memory import keep_freed_memory_for_reuse
    from modelyard.engine.model_runner import DTYPES, ModelRunner
    from modelyard.engine.models.loader import load_model

    device = rank_device(torch.device(spec.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory_for_reuse()
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore(
        "127.0.0.1", master_port, spec.world_size, is_master=False, timeout=timeout
    )
    store.set(f"up/{rank}", "1")
    dist.init_process_group(
        backend_for(device), store=store, rank=rank, world_size=spec.world_size, timeout=timeout
    )
    try:
        dtype = DTYPES[spec.dtype]
        loaded = load_model(
            Path(spec.folder),
            dtype,
            device,
            spec.max_model_len,
            tp_rank=rank,
            tp_size=spec.world_size,
        )
        runner = ModelRunner(
            loaded.model,
            loaded.config,
            spec.num_blocks,
            spec.block_size,
            dtype,
            device,
            tp_size=spec.world_size,
            kv_dtype=DTYPES[spec.kv_dtype],
        )
        store.set(f"loaded/{rank}", "1")
        store.wait(["go"], timedelta(seconds=STARTUP_TIMEOUT_S))
        log.info("rank %d of %d ready on %s", rank, spec.world_size, device)
        steps = serve_steps(runner)
        log.info("rank %d stopping after %d steps", rank, steps)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A tensor-parallel helper rank (not for users).")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args(argv)
    # Rank 0 decides when helpers stop; Ctrl-C in a terminal reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(args.parent_pid)
    spec = HelperSpec(**json.loads(args.spec))
    rank = int(os.environ["RANK"])
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
    )
    try:
        run_helper(spec, rank, int(os.environ["MASTER_PORT"]))
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        sys.exit(1)


if __name__ == "__main__":
    main()
