"""`engine/defaults.py`: what `quantization: auto` and `kv_cache_dtype: auto` choose for a model
file on a CPU, and that a setting (`none` included) wins; what a GGUF file is read as."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelyard.config import EngineSettings
from modelyard.engine.defaults import (
    CpuFeatures,
    ModelFile,
    choose_defaults,
    describe_model_file,
)
from tests.tiny_gguf import build_gguf
from tests.tiny_models import build_model

AVX2 = CpuFeatures(frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"}), fbgemm=True, int8pack=True)
VNNI = CpuFeatures(
    frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}), fbgemm=True, int8pack=True
)
ARM = CpuFeatures(frozenset({"fp", "asimd"}), fbgemm=False, int8pack=True)
BARE = CpuFeatures(frozenset(), fbgemm=False, int8pack=False)
Q4_1, Q8_0, Q6_K = ModelFile("gguf", "Q4_1"), ModelFile("gguf", "Q8_0"), ModelFile("gguf", "Q6_K")
F16_GGUF, HF = ModelFile("gguf", "F16"), ModelFile("hf")
AUTO = EngineSettings()


@pytest.mark.parametrize("model", [Q4_1, Q8_0, Q6_K, ModelFile("gguf", "Q4_K")])
def test_a_quantized_gguf_gets_the_fastest_int8_mode_of_the_cpu(model: ModelFile) -> None:
    avx2 = choose_defaults(model, AVX2, AUTO)
    if model.weight_type in ("Q4_1", "Q8_0"):  # blocks the C matmul reads: kept for decode
        assert avx2.quantization == "gguf+w8a8" and "GGUF blocks" in avx2.quantization_reason
    else:
        assert avx2.quantization == "w8a8" and "FBGEMM" in avx2.quantization_reason
    assert f"file is {model.weight_type} GGUF" in avx2.quantization_reason
    vnni = choose_defaults(model, VNNI, AUTO)
    assert vnni.quantization == "w8a8" and "AVX-512 VNNI" in vnni.quantization_reason
    assert choose_defaults(model, ARM, AUTO).quantization == "int8"
    bare = choose_defaults(model, BARE, AUTO)
    assert bare.quantization == "none" and "no int8 kernel" in bare.quantization_reason


@pytest.mark.parametrize(
    "model", [F16_GGUF, ModelFile("gguf", "F32"), ModelFile("gguf", "BF16"), HF]
)
@pytest.mark.parametrize("cpu", [AVX2, VNNI, ARM])
def test_float_files_stay_unquantized(model: ModelFile, cpu: CpuFeatures) -> None:
    choice = choose_defaults(model, cpu, AUTO)
    assert choice.quantization == "none" and choice.kv_cache_dtype == "auto"


def test_the_kv_cache_is_bfloat16_only_where_it_measured_faster() -> None:
    # AVX2 (AMD EPYC, BENCHMARKS.md): no faster, so the model's dtype (float32 under w8a8).
    assert choose_defaults(Q4_1, AVX2, AUTO).kv_cache_dtype == "auto"
    vnni = choose_defaults(Q4_1, VNNI, AUTO)
    assert vnni.kv_cache_dtype == "bfloat16" and "measured faster" in vnni.kv_reason
    # Unquantized weights keep the model's dtype for their cache, whatever the CPU.
    assert choose_defaults(HF, VNNI, AUTO).kv_cache_dtype == "auto"


@pytest.mark.parametrize("cpu", [AVX2, VNNI, ARM])
def test_a_setting_wins_none_included(cpu: CpuFeatures) -> None:
    none = choose_defaults(Q4_1, cpu, EngineSettings(quantization="none"))
    assert none.quantization == "none" and none.quantization_reason == "set"
    assert choose_defaults(Q4_1, cpu, EngineSettings(quantization="int8")).quantization == "int8"
    w8a8 = choose_defaults(HF, cpu, EngineSettings(quantization="w8a8"))
    assert w8a8.quantization == "w8a8"
    kv = choose_defaults(Q4_1, cpu, EngineSettings(kv_cache_dtype="float32"))
    assert kv.kv_cache_dtype == "float32" and kv.kv_reason == "set"
    assert choose_defaults(Q4_1, cpu, EngineSettings(kv_cache_dtype="bfloat16")).kv_cache_dtype == (
        "bfloat16"
    )


def test_python_none_means_unquantized() -> None:
    assert EngineSettings(quantization=None).quantization == "none"  # type: ignore[arg-type]
    assert EngineSettings().quantization == "auto"


def test_where_int8_cannot_serve_the_file_stays_float() -> None:
    cuda = choose_defaults(Q4_1, AVX2, AUTO, device_type="cuda")
    assert cuda.quantization == "none" and "cuda" in cuda.quantization_reason
    tp = choose_defaults(Q4_1, AVX2, EngineSettings(tensor_parallel_size=2))
    assert tp.quantization == "none" and "tensor_parallel_size" in tp.quantization_reason
    # w8a8 takes float32: under bfloat16 the weight-only mode, where its kernel is fast.
    bf16 = EngineSettings(dtype="bfloat16")
    assert choose_defaults(Q4_1, VNNI, bf16).quantization == "int8"
    assert choose_defaults(Q4_1, VNNI, bf16).kv_cache_dtype == "auto"
    assert choose_defaults(Q4_1, AVX2, bf16).quantization == "none"  # int8pack: no AVX2 path


def test_the_line_says_what_and_why() -> None:
    line = choose_defaults(Q6_K, AVX2, AUTO).line("float32")
    assert line.startswith("quantization w8a8 (file is Q6_K GGUF, CPU avx2: FBGEMM), kv cache")
    assert "float32" in line
    line = choose_defaults(Q4_1, AVX2, AUTO).line("float32")
    assert line.startswith("quantization gguf+w8a8 (file is Q4_1 GGUF, CPU avx2: GGUF blocks")


def test_blocks_are_kept_by_default_only_where_the_c_kernels_run() -> None:
    """Without the C kernels the blocks would be dequantized on every call: plain w8a8."""
    no_kernels = choose_defaults(Q4_1, AVX2, EngineSettings(cpu_kernels=False))
    assert no_kernels.quantization == "w8a8" and "FBGEMM" in no_kernels.quantization_reason
    no_fbgemm = CpuFeatures(AVX2.flags, fbgemm=False, int8pack=True)
    assert choose_defaults(Q4_1, no_fbgemm, AUTO).quantization == "none"


def test_a_gguf_file_is_read_as_its_weights_type(tmp_path: Path) -> None:
    from modelyard.engine.models.loader import to_hf_folder

    hf = build_model(tmp_path / "hf", "llama")
    for weight_type in ("Q4_1", "F32"):
        path = build_gguf(tmp_path / f"tiny-{weight_type}.gguf", weight_type, folder=hf)
        folder = to_hf_folder(path, tmp_path / "cache")
        assert describe_model_file(path, folder) == ModelFile("gguf", weight_type)
        # A folder converted before the types were recorded is given them on first read.
        (folder / "source.json").write_text("{}")
        assert describe_model_file(path, folder) == ModelFile("gguf", weight_type)
        assert describe_model_file(folder, folder) == HF  # the converted folder named itself


def test_a_gguf_rewritten_in_place_is_converted_anew(tmp_path: Path) -> None:
    """The file's hash, which names its conversion, is kept per version of the file: the same
    path looked up twice is one conversion; rewritten, it is another (not the stale one)."""
    from modelyard.engine.models.loader import to_hf_folder

    hf = build_model(tmp_path / "hf", "llama")
    path = build_gguf(tmp_path / "tiny.gguf", "Q4_1", folder=hf)
    first = to_hf_folder(path, tmp_path / "cache")
    assert to_hf_folder(path, tmp_path / "cache") == first
    build_gguf(tmp_path / "tiny.gguf", "F32", folder=hf)  # the same path, new contents
    second = to_hf_folder(path, tmp_path / "cache")
    assert second != first
    assert describe_model_file(path, second) == ModelFile("gguf", "F32")
