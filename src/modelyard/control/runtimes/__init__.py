"""Runtimes: what runs a replica, chosen by the deploy's `framework`.

`native` is modelyard's own `modelyard worker`. The others are OpenAI-compatible servers run by
a sidecar (`modelyard runtime`, `control/runtimes/sidecar.py`) that owns the replica's port:
it launches the server on a private loopback port, passes the OpenAI routes through, and
answers `/health` and `/metrics` in the platform's terms (load report with an admission
limit, series under modelyard's names), so the control plane and the gateway treat the
replica as they treat a native one.

A runtime missing on the node is refused at deploy (400 `framework_unavailable`, naming what
to install) rather than failing every replica start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelyard.config import PlatformSettings
from modelyard.control.runtimes import llama_cpp, vllm
from modelyard.core.errors import Invalid

NATIVE = "native"
FRAMEWORKS = (NATIVE, llama_cpp.NAME, vllm.NAME)


@dataclass(frozen=True)
class RuntimeLaunch:
    """How the sidecar is started for one replica: `modelyard runtime <args>`."""

    framework: str
    executable: str
    slots: int

    def args(self, model_path: Path, served_name: str, options: dict[str, Any]) -> tuple[str, ...]:
        """`modelyard runtime`'s options (the local backend adds --host and --port)."""
        if self.framework == llama_cpp.NAME:
            extra, context = llama_cpp.server_args(options), llama_cpp.context_of(options)
        else:
            extra, context = vllm.server_args(options), int(options.get("max_model_len") or 0)
        return (
            "--framework", self.framework, "--executable", self.executable,
            "--model", str(model_path), "--served-model-name", served_name,
            "--slots", str(self.slots), *(("--context", str(context)) if context else ()),
            *(f"--runtime-arg={a}" for a in extra),
        )  # fmt: skip


def check_framework(settings: PlatformSettings, framework: str) -> None:
    """400 for a framework nothing here knows, or one not installed on this node."""
    if framework not in FRAMEWORKS:
        raise Invalid(
            f"framework {framework!r} is not supported; use one of {', '.join(FRAMEWORKS)} "
            "(native: modelyard's own engine)",
            param="framework",
            code="unsupported_framework",
        )
    if framework == NATIVE:
        return
    if locate(settings, framework) is None:
        raise Invalid(
            f"framework {framework!r} is not installed on this node: {install_hint(framework)}",
            param="framework",
            code="framework_unavailable",
        )


def locate(settings: PlatformSettings, framework: str) -> str | None:
    if framework == llama_cpp.NAME:
        return llama_cpp.locate(settings.llama_server_path)
    if framework == vllm.NAME:
        return vllm.locate()
    return None


def install_hint(framework: str) -> str:
    return llama_cpp.INSTALL_HINT if framework == llama_cpp.NAME else vllm.INSTALL_HINT


def launch(settings: PlatformSettings, framework: str, options: dict[str, Any]) -> RuntimeLaunch:
    """The sidecar's launch for a replica of `framework` (checked available at deploy; a node
    that lost it since fails the replica start with the same hint)."""
    executable = locate(settings, framework)
    if executable is None:
        raise RuntimeError(f"{framework} is not installed on this node: {install_hint(framework)}")
    return RuntimeLaunch(framework, executable, slots_of(options))


def slots_of(options: dict[str, Any]) -> int:
    """Parallel sequences a runtime replica serves: the deploy's `engine.max_num_seqs`, else a
    small default (a llama.cpp slot reserves its whole context up front)."""
    return max(1, int(options.get("max_num_seqs") or 8))


def spec_fields(
    settings: PlatformSettings,
    framework: str,
    options: dict[str, Any],
    model_path: Path,
    served_name: str,
) -> dict[str, Any]:
    """`ReplicaSpec`'s command and arguments for a replica of `framework` (none for native)."""
    if framework == NATIVE:
        return {}
    how = launch(settings, framework, options)
    return {"command": "runtime", "args": how.args(model_path, served_name, options)}
