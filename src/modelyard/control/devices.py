"""The device inventory of a node: which devices it has and how much memory each offers.

Either declared with the `MODELYARD_DEVICES` syntax (`cpu:4x6GiB`, `cpu:2x8GiB,cpu:1x16GiB`,
`cuda:2x80GiB`) or discovered: the CUDA devices torch sees, else one CPU "device" whose budget is
80 % of the machine's RAM. Declared CPU devices are memory budgets, not hardware: they let every
scheduling path (sharing, multi-device replicas) run and be tested on a machine without a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from modelyard.config import parse_size

DeviceKind = Literal["cuda", "cpu"]
KINDS: tuple[DeviceKind, ...] = ("cuda", "cpu")

_SPEC_FORM = "KIND:COUNTxSIZE[,KIND:COUNTxSIZE...], e.g. cpu:4x6GiB or cuda:2x80GiB"
_GROUP = re.compile(r"\s*(?P<kind>[a-z]+)\s*:\s*(?:(?P<count>\d+)\s*[xX]\s*)?(?P<size>\S+?)\s*")
_MEMINFO = Path("/proc/meminfo")
# Present when a GPU driver is loaded (NVIDIA's control device and proc folder, ROCm's kfd):
# without one, no device count is asked of torch, whose import costs the control plane seconds.
_GPU_DRIVER_PATHS = (Path("/dev/nvidiactl"), Path("/proc/driver/nvidia"), Path("/dev/kfd"))
_CPU_SHARE_OF_RAM = 0.8  # leave the rest to the OS, the control plane and the page cache
_FALLBACK_RAM = 8 * 2**30


@dataclass(frozen=True)
class Device:
    node: str
    index: int
    kind: DeviceKind
    memory_bytes: int

    @property
    def name(self) -> str:
        """`cuda:0`, `cpu:1`: the torch device string on its own node."""
        return f"{self.kind}:{self.index}"

    @property
    def qualified_name(self) -> str:
        """`node-a/cuda:0`: unique across a fleet of nodes."""
        return f"{self.node}/{self.name}"


def parse_devices(spec: str, node: str = "local") -> list[Device]:
    """Devices declared by a `MODELYARD_DEVICES` string; indices count on per kind."""
    devices: list[Device] = []
    next_index = dict.fromkeys(KINDS, 0)
    if not spec.strip():
        raise ValueError(f"empty device spec; expected {_SPEC_FORM}")
    for group in spec.split(","):
        match = _GROUP.fullmatch(group)
        if not match:
            raise ValueError(f"bad device group {group.strip()!r}; expected {_SPEC_FORM}")
        kind = match.group("kind")
        if kind not in KINDS:
            raise ValueError(f"unknown device kind {kind!r} (cuda or cpu); expected {_SPEC_FORM}")
        count = int(match.group("count") or 1)
        try:
            size = parse_size(match.group("size"))
        except ValueError:
            raise ValueError(
                f"bad device size {match.group('size')!r} in {group.strip()!r}; "
                f"expected {_SPEC_FORM}"
            ) from None
        if count < 1 or size < 1:
            raise ValueError(
                f"device count and size must be positive in {group.strip()!r}; "
                f"expected {_SPEC_FORM}"
            )
        for _ in range(count):
            typed = cast(DeviceKind, kind)
            devices.append(Device(node, next_index[typed], typed, size))
            next_index[typed] += 1
    return devices


def _ram_bytes() -> int:
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    return _FALLBACK_RAM


def inventory(spec: str | None, node: str = "local") -> list[Device]:
    """The node's devices: declared by `spec`, else the CUDA devices, else one CPU budget."""
    if spec is not None:
        return parse_devices(spec, node)
    if not any(path.exists() for path in _GPU_DRIVER_PATHS):
        return [_cpu_budget(node)]
    try:
        import torch  # lazily: the control plane must not pay torch's import for a declared fleet
    except ImportError:
        torch = None  # type: ignore[assignment]
    if torch is not None:
        count = torch.cuda.device_count()
        if count > 0:
            return [
                Device(node, i, "cuda", int(torch.cuda.get_device_properties(i).total_memory))
                for i in range(count)
            ]
    return [_cpu_budget(node)]


def _cpu_budget(node: str) -> Device:
    return Device(node, 0, "cpu", int(_ram_bytes() * _CPU_SHARE_OF_RAM))


def pinning_env(devices: list[Device]) -> dict[str, str]:
    """Environment that confines a replica's process to the devices it was placed on (CUDA
    numbers its visible devices from 0; CPU "devices" are memory budgets, nothing to pin)."""
    if devices and devices[0].kind == "cuda":
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(d.index) for d in devices)}
    return {}
