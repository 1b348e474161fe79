"""A tensor-parallel helper rank's process (`python -m modelyard.engine.tensor_parallel.helper`,
started by rank 0's `leader.TensorParallelLeader`; not for users).

It joins rank 0's process group, loads its shard of the weights and a KV cache for its KV heads,
then runs each step rank 0 broadcasts (`wire.unpack_step`) through its own `ModelRunner.forward`
until rank 0 says stop. It dies with rank 0's spawning thread (`PR_SET_PDEATHSIG`), and a helper
blocked in a collective sees rank 0's closed connection at once.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
from contextlib import suppress
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # what torch.distributed re-exports

from modelyard.engine.memory import keep_freed_memory_for_reuse
from modelyard.engine.model_runner import DTYPES, ModelRunner
from modelyard.engine.models.loader import load_model
from modelyard.engine.tensor_parallel.wire import (
    CMD_NOOP,
    CMD_STEP,
    CMD_STOP,
    COLLECTIVE_TIMEOUT_S,
    HEADER_LEN,
    STARTUP_TIMEOUT_S,
    HelperSpec,
    TensorParallelError,
    backend_for,
    rank_device,
    unpack_step,
)

log = logging.getLogger("modelyard.engine.tensor_parallel")  # also when run as __main__

_PR_SET_PDEATHSIG = 1


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
        received = torch.empty(HEADER_LEN, dtype=torch.long, device=device)
        while True:
            dist.broadcast(received, src=0)
            values = received.tolist()
            cmd = values[0]
            if cmd == CMD_STOP:
                return steps
            if cmd == CMD_NOOP:
                continue
            if cmd != CMD_STEP:
                raise TensorParallelError(f"unknown command {cmd} from rank 0")
            payload = torch.empty(values[1], dtype=torch.long, device=device)
            dist.broadcast(payload, src=0)
            input_ids, positions, meta = unpack_step(values, payload, runner.block_size)
            runner.forward(input_ids, positions, meta)
            steps += 1


def run_helper(spec: HelperSpec, rank: int, master_port: int) -> None:
    device = rank_device(torch.device(spec.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory_for_reuse()
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = TCPStore("127.0.0.1", master_port, spec.world_size, is_master=False, timeout=timeout)
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
