"""The vLLM runtime (GPU nodes): `vllm serve` from the `vllm` package installed on the node.

Located as the `vllm` command on PATH, else beside the running interpreter (a venv's bin).
Its series are already named `vllm:*`, which the platform's dashboards read; the sidecar adds
modelyard's names for the same gauges and counters.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

NAME = "vllm"
INSTALL_HINT = "install the `vllm` package on the node (pip install vllm; it needs a GPU)"

METRICS = {
    "vllm:num_requests_running": "modelyard_num_requests_running",
    "vllm:num_requests_waiting": "modelyard_num_requests_waiting",
    "vllm:kv_cache_usage_perc": "modelyard_kv_cache_usage_ratio",
    "vllm:prompt_tokens": "modelyard_prompt_tokens",
    "vllm:generation_tokens": "modelyard_generation_tokens",
    "vllm:num_preemptions": "modelyard_num_preemptions",
}
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


def locate() -> str | None:
    found = shutil.which("vllm")
    if found:
        return found
    beside = Path(sys.executable).parent / "vllm"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def server_args(options: dict[str, Any]) -> tuple[str, ...]:
    args: list[str] = []
    if options.get("dtype") and options["dtype"] != "auto":
        args += ["--dtype", str(options["dtype"])]
    if options.get("tensor_parallel_size"):
        args += ["--tensor-parallel-size", str(int(options["tensor_parallel_size"]))]
    return tuple(args)


def command(
    executable: str,
    model_path: Path,
    served_name: str,
    port: int,
    slots: int,
    context: int | None,
    extra: list[str],
) -> list[str]:
    """`vllm serve` on loopback `port`, at most `slots` sequences per step."""
    cmd = [
        executable, "serve", str(model_path), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", served_name, "--max-num-seqs", str(slots),
    ]  # fmt: skip
    if context:
        cmd += ["--max-model-len", str(context)]
    return cmd + extra
