"""CPU kernels in C, compiled on first use with the machine's C compiler and called via ctypes.

PyTorch has no paged attention for CPUs: decoding gathered every sequence's KV blocks into a
padded copy, then ran a flash-attention kernel built for long queries over it, which was half
of a 32-sequence decode step. `csrc/paged_attention.c` reads the blocks where they lie.

The kernel is plain C with no PyTorch headers, so it builds in about a second. It is compiled
for this CPU (`-march=native`) into `<cache_dir>/kernels`, under a name that hashes the source,
the options, the compiler and the CPU's flags, so a cache shared by different machines never
loads code built for another CPU. Where no compiler works, or with `cpu_kernels` off
(`MODELYARD_CPU_KERNELS=false`), the engine keeps PyTorch's path (`load_decode_attention`
returns None and logs why once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
DTYPES = (torch.float32, torch.bfloat16)
_OPTIMIZE = [
    "-O3",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",  # lets the compiler vectorise the dot products' sums
    "-ffinite-math-only",  # and the softmax's max and exp (no inf or NaN is made on purpose)
]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(source: Path, compiler: str, kernel_dir: Path) -> Path:
    """The shared library of `source` for this CPU, compiled unless already cached."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    key = hashlib.sha256(
        "\0".join(
            [source.read_text(), *_OPTIMIZE, compiler, version, platform.machine(), _cpu_flags()]
        ).encode()
    ).hexdigest()[:16]
    target = kernel_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for arch in (["-march=native"], []):  # some compilers (or CPUs) have no -march=native
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        command = [compiler, *_OPTIMIZE, *arch, "-fPIC", "-shared", "-pthread"]
        done = subprocess.run(
            [*command, str(source), "-o", str(partial), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode == 0:
            partial.replace(target)  # atomic: concurrent builders each write a whole file
            return target
        partial.unlink(missing_ok=True)
        errors.append(done.stderr.strip()[-500:])
    raise RuntimeError("; ".join(errors))


class DecodeAttention:
    """`paged_decode_attention` of `csrc/paged_attention.c`: one query token per sequence."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.paged_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = (
            [ctypes.c_void_p] * 6
            + [ctypes.c_int64] * 6
            + [
                ctypes.c_float,
                ctypes.c_int,
                ctypes.c_int,
            ]
        )
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,  # [B, heads, head_dim] float32, contiguous
        cache: torch.Tensor,  # [2, slots, kv_heads, head_dim] float32 or bfloat16, contiguous
        block_tables: torch.Tensor,  # [B, max_blocks] int64, contiguous
        context_lens: torch.Tensor,  # [B] int64, each >= 1
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """Attention output `[B, heads, head_dim]` float32."""
        batch, heads, dim = q.shape
        out = torch.empty_like(q)
        failed = self._fn(
            q.data_ptr(),
            cache[0].data_ptr(),
            cache[1].data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            batch,
            heads,
            cache.shape[2],
            dim,
            block_size,
            block_tables.shape[1],
            scale,
            int(cache.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("paged decode attention: no memory for the attention scores")
        return out


@functools.cache
def load_decode_attention(cache_dir: Path) -> DecodeAttention | None:
    """The compiled decode-attention kernel (built once per process), or None where it cannot
    be built here."""
    return build_decode_attention(cache_dir)


def build_decode_attention(cache_dir: Path) -> DecodeAttention | None:
    """Compile (unless cached under `cache_dir/kernels`) and load the kernel; None, logged,
    where that fails."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (cc, gcc or $CC): decode attention runs in PyTorch (slower)")
        return None
    try:
        library = ctypes.CDLL(str(_build(SOURCE, compiler, cache_dir / "kernels")))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("the C decode-attention kernel did not build (%s): PyTorch runs it", exc)
        return None
    return DecodeAttention(library)


def decode_attention_for(
    device: torch.device, dtype: torch.dtype, cache_dir: Path
) -> DecodeAttention | None:
    """The kernel where it serves an engine on `device` with a `dtype` KV cache, else None."""
    if device.type != "cpu" or dtype not in DTYPES:
        return None
    return load_decode_attention(cache_dir)
