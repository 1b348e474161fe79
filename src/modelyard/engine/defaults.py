"""What `quantization: auto` and `kv_cache_dtype: auto` mean for one model file on this machine:
`choose_defaults`, the one place that decides, and the facts it decides from.

Weights: a GGUF file stored quantized (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...) is served with the
first of `QUANTIZED_FILE_MODES` that runs here (AVX-512 VNNI: `w8a8` in C; other x86 CPUs
with AVX2: `gguf+w8a8` for Q4_0/Q4_1/Q8_0 files, `w8a8` under FBGEMM for the others; ARM:
`int8`); a float file (F32/F16/BF16 GGUF, safetensors)
stays unquantized. A new mode (say, GGUF blocks read in place) is one more `QuantMode` placed
before the modes it beats. Nothing is quantized off the CPU (`int8` only dequantizes on the fly
there), with `tensor_parallel_size` > 1 (refused), or where no int8 kernel beats float (`w8a8`
takes float32 activations; `int8`'s kernel is slow on AVX2-only CPUs).

KV cache: under int8 weights and a float32 model, bfloat16 where it measured faster than float32
(`benchmarks/kv_cache_dtype.py`, BENCHMARKS.md): CPUs with AVX512-BF16 (1.02-1.07x per decode
step, Zen 4) and `BF16_KV_FASTER_ON_AVX2`; elsewhere the model's dtype.

An explicit setting (`none` included) wins over each of them; the choice says why it was made.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from modelyard.config import EngineSettings

# GGUF tensor types that store floats as they are; every other type is a quantization.
# Those the C matmul reads in place (`gguf_linear`): Q4_0, Q4_1, Q8_0.
BLOCK_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0"})
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
# Measured (benchmarks/kv_cache_dtype.py, SmolLM2 w8a8, AMD EPYC AVX2 2 vCPU, BENCHMARKS.md).
BF16_KV_FASTER_ON_AVX2 = False


@dataclass(frozen=True)
class ModelFile:
    """What the choice needs of a model: its format and the type most of its weights are in."""

    format: str  # "gguf" or "hf" (a Hugging Face folder)
    weight_type: str = "F32"  # GGUF: the dominant tensor type of its matrices, e.g. "Q4_1"

    @property
    def quantized(self) -> bool:
        return self.format == "gguf" and self.weight_type not in FLOAT_TYPES

    @property
    def label(self) -> str:
        return f"{self.weight_type} GGUF" if self.format == "gguf" else "a float checkpoint"


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's instruction-set flags and which int8 matmuls torch runs on it."""

    flags: frozenset[str]
    fbgemm: bool  # FBGEMM's dynamic int8 linear (x86 builds of torch)
    int8pack: bool  # aten._weight_int8pack_mm

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def label(self) -> str:
        for flag in ("amx_bf16", "avx512_vnni", "avx512_bf16", "avx512f", "avx2", "neon", "asimd"):
            if flag in self.flags:
                return flag
        return platform.machine() or "unknown"


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's `CpuFeatures` (read once)."""
    from modelyard.engine.kernel_build import cpu_flags
    from modelyard.engine.quantization import fbgemm_available, int8_kernel_available

    line = cpu_flags()
    flags = frozenset(line.partition(":")[2].split()) if ":" in line else frozenset(line.split())
    return CpuFeatures(flags, fbgemm_available(), int8_kernel_available("cpu"))


def describe_model_file(path: Path, folder: Path) -> ModelFile:
    """`path`: the model as named (a .gguf file or a folder); `folder`: what it loads from."""
    if path.is_file() and path.suffix == ".gguf":
        from modelyard.engine.models.gguf_convert import gguf_weight_type

        return ModelFile("gguf", gguf_weight_type(path, folder))
    return ModelFile("hf")


@dataclass(frozen=True)
class QuantMode:
    """One way to serve a quantized file: the `quantization` value, when it runs, and why."""

    name: str
    runs: Callable[[ModelFile, CpuFeatures, EngineSettings], bool]
    why: str


def _float32_model(settings: EngineSettings) -> bool:
    return settings.dtype in ("auto", "float32")


# For a quantized file, the first that runs here (fastest first).
QUANTIZED_FILE_MODES: tuple[QuantMode, ...] = (
    QuantMode(
        "w8a8",
        lambda f, cpu, s: cpu.fbgemm and cpu.has("avx512_vnni") and _float32_model(s),
        "C int8 kernels (AVX-512 VNNI)",
    ),
    # Other x86 CPUs: a file of blocks the C matmul reads keeps them for decode steps of up to 4
    # sequences (one C call; on AVX2 1.4-1.6x w8a8's single-stream tokens/s, BENCHMARKS.md) and
    # takes w8a8's FBGEMM copy for prefill and wider batches (2-4x faster there than blocks).
    QuantMode(
        "gguf+w8a8",
        lambda f, cpu, s: (
            cpu.fbgemm
            and cpu.has("avx2")
            and f.format == "gguf"
            and f.weight_type in BLOCK_TYPES
            and s.cpu_kernels
            and _float32_model(s)
        ),
        "GGUF blocks for 1-4-row decode steps in one C call, FBGEMM w8a8 for wider matmuls",
    ),
    QuantMode("w8a8", lambda f, cpu, s: cpu.fbgemm and _float32_model(s), "FBGEMM"),
    # PyTorch's int8pack kernel has no AVX2 path: 3x slower than float32 there (BENCHMARKS.md).
    QuantMode(
        "int8",
        lambda f, cpu, s: cpu.int8pack and (cpu.has("avx512f") or not cpu.has("avx2")),
        "int8 weight-only",
    ),
)


@dataclass(frozen=True)
class Choice:
    """The quantization and KV cache type an engine loads with, and why, in words."""

    quantization: str  # "none", "int8", "w8a8", "gguf", "gguf+w8a8"
    kv_cache_dtype: str  # "float32", "bfloat16", or "auto": the model's dtype
    quantization_reason: str
    kv_reason: str

    @property
    def quantized(self) -> bool:
        return self.quantization != "none"

    def line(self, kv_dtype: str) -> str:
        """The one line a worker logs at load, with the KV dtype as resolved."""
        return (
            f"quantization {self.quantization} ({self.quantization_reason}), "
            f"kv cache {kv_dtype} ({self.kv_reason})"
        )


def choose_defaults(
    model: ModelFile, cpu: CpuFeatures, settings: EngineSettings, device_type: str = "cpu"
) -> Choice:
    """The quantization and KV cache dtype for `model` here (see the module docstring)."""
    quantization, why = _quantization(model, cpu, settings, device_type)
    kv, kv_why = _kv_cache_dtype(quantization, cpu, settings, device_type)
    return Choice(quantization, kv, why, kv_why)


def _quantization(
    model: ModelFile, cpu: CpuFeatures, settings: EngineSettings, device_type: str
) -> tuple[str, str]:
    if settings.quantization != "auto":
        return settings.quantization, "set"
    if not model.quantized:
        return "none", f"file is {model.label}"
    where = f"file is {model.label}"
    if device_type != "cpu":
        return "none", f"{where}, on {device_type}: int8 runs no faster than its dtype there"
    if settings.tensor_parallel_size > 1:
        return "none", f"{where}, tensor_parallel_size > 1 takes no quantization"
    for mode in QUANTIZED_FILE_MODES:
        if mode.runs(model, cpu, settings):
            return mode.name, f"{where}, CPU {cpu.label}: {mode.why}"
    return "none", f"{where}, CPU {cpu.label}: no int8 kernel faster than float runs here"


def _kv_cache_dtype(
    quantization: str, cpu: CpuFeatures, settings: EngineSettings, device_type: str
) -> tuple[str, str]:
    if settings.kv_cache_dtype != "auto":
        return settings.kv_cache_dtype, "set"
    if quantization == "none" or device_type != "cpu":
        return "auto", "the model's dtype"
    if settings.dtype == "bfloat16":
        return "auto", "the model's dtype"
    if cpu.has("avx512_bf16") or cpu.has("amx_bf16"):
        return "bfloat16", f"int8 weights, CPU {cpu.label}: measured faster than float32"
    if cpu.has("avx2") and BF16_KV_FASTER_ON_AVX2:
        return "bfloat16", f"int8 weights, CPU {cpu.label}: measured faster than float32"
    return "auto", f"the model's dtype: CPU {cpu.label} measured no faster with bfloat16"


@dataclass(frozen=True)
class Numerics:
    """What an engine computes in, as loaded, and why: the worker's /health shows it."""

    quantization: str  # "none", "int8", "w8a8", "gguf", "gguf+w8a8"
    dtype: str  # weights and activations: "float32", "bfloat16"
    kv_cache_dtype: str
    reason: str  # the one line the worker logs at load

    @classmethod
    def of(cls, choice: Choice, dtype: str, kv_dtype: str) -> Numerics:
        return cls(choice.quantization, dtype, kv_dtype, choice.line(kv_dtype))
