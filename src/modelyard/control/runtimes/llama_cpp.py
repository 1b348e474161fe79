"""The llama.cpp runtime: `llama-server` on a GGUF file, `-np` parallel slots.

Where the binary comes from: the `llama_server_path` setting, else `llama-server` on PATH, else
the cache `make llama-server` (benchmarks/llama_cpp_build.py) builds into. Its Prometheus
series (`--metrics`, prefix `llamacpp:`) are mapped onto modelyard's names by the sidecar.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

NAME = "llama.cpp"
INSTALL_HINT = (
    "install llama.cpp's `llama-server` on the node and put it on PATH, or set "
    "MODELYARD_LLAMA_SERVER_PATH to it (`make llama-server` builds one into "
    "~/.cache/modelyard/llama.cpp/bin)"
)
BUILD_CACHE = Path.home() / ".cache" / "modelyard" / "llama.cpp" / "bin" / "llama-server"
DEFAULT_CONTEXT = 2048  # tokens per slot when the deploy sets no max_model_len

# llama-server series -> modelyard's (the worker's own names, `worker/metrics.py`), by family
# name (a counter's without `_total`, as Prometheus' parser names it).
METRICS = {
    "llamacpp:requests_processing": "modelyard_num_requests_running",
    "llamacpp:requests_deferred": "modelyard_num_requests_waiting",
    "llamacpp:prompt_tokens": "modelyard_prompt_tokens",
    "llamacpp:tokens_predicted": "modelyard_generation_tokens",
    "llamacpp:n_decode": "modelyard_engine_steps",
}
RUNNING, WAITING = "llamacpp:requests_processing", "llamacpp:requests_deferred"


def _executable(path: Path | str | None) -> str | None:
    if path is None:
        return None
    p = Path(path).expanduser()
    return str(p) if p.is_file() and os.access(p, os.X_OK) else None


def locate(configured: Path | None) -> str | None:
    """The `llama-server` to run: the configured one (only it, when set), else PATH's, else
    the build cache's."""
    if configured is not None:
        return _executable(configured)
    return shutil.which("llama-server") or _executable(BUILD_CACHE)


def context_of(options: dict[str, Any]) -> int:
    return int(options.get("max_model_len") or DEFAULT_CONTEXT)


def server_args(options: dict[str, Any]) -> tuple[str, ...]:
    """Deploy engine options that mean something to llama-server, as its arguments."""
    args: list[str] = []
    if options.get("num_threads"):
        threads = str(int(options["num_threads"]))
        args += ["-t", threads, "-tb", threads]
    return tuple(args)


def gguf_file(model_path: Path) -> Path:
    """The GGUF to load: the artifact itself, or the one `.gguf` in its folder (a registry
    version's files)."""
    if model_path.is_file():
        if model_path.suffix != ".gguf":
            raise ValueError(f"llama.cpp serves GGUF files; {model_path.name} is not one")
        return model_path
    found = sorted(model_path.rglob("*.gguf"))
    if len(found) != 1:
        what = "no .gguf file" if not found else f"{len(found)} .gguf files"
        raise ValueError(f"llama.cpp serves one GGUF file; the model has {what}")
    return found[0]


def command(
    executable: str,
    model_path: Path,
    served_name: str,
    port: int,
    slots: int,
    context: int,
    extra: list[str],
) -> list[str]:
    """llama-server on loopback `port`: `slots` parallel sequences of `context` tokens each
    (its `-c` is the total, split among the slots), continuous batching, metrics on."""
    return [
        executable, "-m", str(gguf_file(model_path)), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "-c", str(slots * context), "--alias", served_name, "--metrics",
        *extra,
    ]  # fmt: skip
