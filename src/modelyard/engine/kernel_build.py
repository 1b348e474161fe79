"""Compile modelyard's C kernels (`csrc/*.c`) for this CPU, once: `-march=native` (where the
compiler takes it), into `<cache_dir>/kernels` under a name that hashes the sources, the
options, the compiler and the CPU's flags, so a cache shared by different machines never loads
code built for another CPU. Concurrent builders each write a whole file and rename it in place.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "thread_pool.c",
        "paged_attention.c",
        "fused_ops.c",
        "int8_matmul.c",
        "amx_matmul.c",
        "gguf_matmul.c",
        "decode_step.c",
        "lora.c",
    )
)
OPTIMIZE = [
    "-O3",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",  # lets the compiler vectorise the dot products' sums
    "-ffinite-math-only",  # and the softmax's max and exp (no inf or NaN is made on purpose)
]
# The interface held to `csrc/kernels.h`: only its MY_API functions exported, and a function
# defined without a prototype in scope (one `kernels.h` or `internal.h` lacks) an error.
INTERFACE = [
    "-fvisibility=hidden",
    "-Werror=missing-prototypes",
    "-Werror=implicit-function-declaration",
]


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(
    sources: tuple[Path, ...], compiler: str, kernel_dir: Path, extra_flags: tuple[str, ...] = ()
) -> Path:
    """The shared library of `sources` for this CPU, compiled unless already cached.
    `extra_flags` after the others (tests build the plain-C forms with `-mno-avx512f`)."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})  # what they include
    key = hashlib.sha256(
        "\0".join(
            [
                *(s.read_text() for s in (*sources, *headers)),
                *OPTIMIZE,
                *INTERFACE,
                *extra_flags,
                compiler,
                version,
                platform.machine(),
                cpu_flags(),
            ]
        ).encode()
    ).hexdigest()[:16]
    target = kernel_dir / f"modelyard-cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for arch in (["-march=native"], []):  # some compilers (or CPUs) have no -march=native
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        command = [
            compiler,
            *OPTIMIZE,
            *INTERFACE,
            *arch,
            *extra_flags,
            "-fPIC",
            "-shared",
            "-pthread",
        ]
        done = subprocess.run(
            [*command, *map(str, sources), "-o", str(partial), "-lm"],
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
