"""Quantization `gguf`: the matmul over a GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks
(`csrc/gguf_matmul.c`) against the float matmul over the same blocks dequantized by the `gguf`
package, in every build this machine runs (its native form: AVX2 here, AVX-512 VNNI on a CPU
that has it; and the portable plain C), plus a compile-only check of the AVX-512 form; then a
tiny GGUF end to end against its dequantized float model; and `gguf+w8a8`, the blocks with a
w8a8 copy for wide matmuls.

The tolerance is the activations' quantization, bounded exactly: x is rounded to int8 in blocks
of 32 with scale d_b = max|x_b| / 127, so |x_i - x^_i| <= d_b / 2 and each output's error is at
most sum_b d_b / 2 * sum_{i in b} |w_i|; a small float-rounding allowance is added on top.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modelyard.config import EngineSettings
from modelyard.engine import kernel_build
from modelyard.engine.attention import AttentionMetadata, PrefillChunk
from modelyard.engine.cpu_kernels import load_kernels
from modelyard.engine.gguf_linear import (
    BLOCK_BYTES,
    BLOCK_ROWS_MAX,
    Q4_0,
    Q4_1,
    Q8_0,
    GGUFEmbedding,
    GGUFLinear,
    dequantize_blocks,
)
from modelyard.engine.models.loader import load_model
from modelyard.engine.quantization import Int8Linear
from tests.parity import PORTABLE_FLAGS, portable_kernel_builds
from tests.tiny_gguf_blocks import HIDDEN, KV_HEADS, LAYERS, VOCAB, build_gguf, hf_folder

pytestmark = pytest.mark.skipif(
    load_kernels(EngineSettings().cache_dir) is None, reason="no C compiler here"
)
CPU = torch.device("cpu")


def random_blocks(rows: int, cols: int, ggml_type: int, gen: np.random.Generator) -> np.ndarray:
    """Blocks with any quant bytes (Q8_0's -128 included) and float16 scales of either sign."""
    nb = cols // 32
    size = BLOCK_BYTES[ggml_type]
    raw = gen.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    scales = (gen.standard_normal((rows, nb, 2)) * 0.02).astype(np.float16)
    raw[..., :2] = scales[..., :1].view(np.uint8)
    if ggml_type == Q4_1:
        raw[..., 2:4] = scales[..., 1:].view(np.uint8)
    return raw.reshape(rows, nb * size)


def dequantized(blocks: np.ndarray, ggml_type: int) -> torch.Tensor:
    import gguf
    from gguf.quants import dequantize

    kind = gguf.GGMLQuantizationType(ggml_type)
    return torch.from_numpy(np.asarray(dequantize(blocks, kind), dtype=np.float32).copy())


def activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[rows, out]: the most the int8 rounding of x (blocks of 32) can move each output."""
    half_step = x.abs().reshape(x.shape[0], -1, 32).amax(dim=2) / 254.0  # [rows, nb]
    w_l1 = w.abs().reshape(w.shape[0], -1, 32).sum(dim=2)  # [out, nb]
    return half_step.double() @ w_l1.double().T


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 9),
    k=st.sampled_from([32, 96, 576, 1536]),
    n=st.sampled_from([1, 3, 37, 101, 333]),
    ggml_type=st.sampled_from([Q4_0, Q4_1, Q8_0]),
    bias=st.booleans(),
    seed=st.integers(0, 999),
    build=st.sampled_from(sorted(portable_kernel_builds())),
)
def test_matmul_within_the_activation_rounding_of_the_float_product(
    rows: int, k: int, n: int, ggml_type: int, bias: bool, seed: int, build: str
) -> None:
    """Odd output counts (not a multiple of the thread split), batches of 1 to 9 rows (tiles of
    4 and their remainders), in_features any multiple of 32; outlier and zero activations."""
    kernels = portable_kernel_builds()[build]
    gen = np.random.default_rng(seed)
    blocks = random_blocks(n, k, ggml_type, gen)
    w = dequantized(blocks, ggml_type)
    x = torch.from_numpy(gen.standard_normal((rows, k)).astype(np.float32)) * 3
    x[0, :32] = 0.0  # an all-zero block
    x[-1, 5] = 400.0  # an outlier coarsens its block only
    b = torch.from_numpy(gen.standard_normal(n).astype(np.float32)) if bias else None
    got = kernels.gguf_matmul(x, torch.from_numpy(blocks), ggml_type, b)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    rounding = 2e-5 * (x.abs().double() @ w.abs().double().T) + 1e-5
    allowed = 1.01 * activation_bound(x, w) + rounding
    assert ((got.double() - want).abs() <= allowed).all()


def test_each_build_runs_the_form_it_was_built_for() -> None:
    builds = portable_kernel_builds()
    flags = kernel_build.cpu_flags().split()
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the vector forms are x86's")
    if "avx512_vnni" in flags and "avx512vl" in flags:
        assert builds["native"].gguf_matmul_isa == 3
    elif "avx2" in flags and "fma" in flags and "f16c" in flags:
        assert builds["native"].gguf_matmul_isa == 2
    assert builds["portable-c"].gguf_matmul_isa == 0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 forms")
def test_the_avx512_form_compiles(tmp_path: Path) -> None:
    """Compile-only on CPUs without AVX-512 (nothing built is loaded); the build fails if the
    AVX-512 VNNI form is not the one compiled (`MY_EXPECT_GGUF_ISA`)."""
    compiler = kernel_build.compiler()
    assert compiler is not None
    flags = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c")
    built = kernel_build.build(
        kernel_build.SOURCES, compiler, tmp_path, (*flags, "-DMY_EXPECT_GGUF_ISA=3")
    )
    assert built.exists()
    with pytest.raises(RuntimeError, match="vector form"):  # and the check itself bites
        kernel_build.build(
            kernel_build.SOURCES, compiler, tmp_path, (*PORTABLE_FLAGS, "-DMY_EXPECT_GGUF_ISA=3")
        )


@pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q8_0])
def test_layers_without_kernels_dequantize_as_gguf_does(ggml_type: int) -> None:
    gen = np.random.default_rng(ggml_type)
    blocks = random_blocks(7, 64, ggml_type, gen)
    w = dequantized(blocks, ggml_type)
    assert torch.equal(dequantize_blocks(torch.from_numpy(blocks), ggml_type), w)
    x = torch.randn(3, 64)
    layer = GGUFLinear(torch.from_numpy(blocks), ggml_type, 64, None)
    torch.testing.assert_close(layer(x), x @ w.T)
    embedding = GGUFEmbedding(torch.from_numpy(blocks), ggml_type, 64, torch.float32)
    assert torch.equal(embedding(torch.tensor([[6, 0]])), w[[6, 0]].unsqueeze(0))


# ----- a tiny GGUF end to end ---------------------------------------------------------------

TYPES = {
    "token_embd": Q8_0,  # the tied LM head too
    "attn_q": Q8_0,
    "attn_k": Q8_0,
    "attn_v": Q8_0,
    "attn_output": Q4_0,
    "ffn_gate": Q4_0,
    "ffn_up": Q4_0,
    "ffn_down": Q4_1,
    "blk.1.attn_v.weight": 0,  # float: layer 1's q|k|v stays a float matmul
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gguf")
    path = build_gguf(root / "tiny.gguf", TYPES)
    return path, hf_folder(path, root / "hf")


def logits_of(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Every position's logits for one prefill of `ids`."""
    n = len(ids)
    caches = [torch.zeros(2, n, KV_HEADS, HIDDEN // 4) for _ in range(LAYERS)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_size=n,
        num_decodes=0,
        decode_block_tables=None,
        decode_mask=None,
        prefills=[PrefillChunk(0, n, 0, None)],
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), meta, caches)
        out: torch.Tensor = model.compute_logits(hidden)  # type: ignore[operator]
    return out


def test_tiny_gguf_blocks_match_the_dequantized_model(tiny: tuple[Path, Path]) -> None:
    """The file's blocks kept (Q8_0 embedding and tied head, Q8_0 q|k|v, Q4_0 o and gate|up,
    Q4_1 down; layer 1's q|k|v float) against the dequantized float model: logits within a
    few per cent of their range, the same greedy tokens, and the weights at the file's size."""
    path, folder = tiny
    fp32 = load_model(folder, torch.float32, CPU, 128).model
    kept = load_model(folder, torch.float32, CPU, 128, quantization="gguf", gguf_path=path).model
    kept.use_kernels(load_kernels(EngineSettings().cache_dir))
    kinds = [type(m).__name__ for m in kept.modules()]
    # 4 matmuls a layer, less layer 1's q|k|v, plus the tied LM head
    assert kinds.count("GGUFLinear") == 4 * LAYERS and "GGUFEmbedding" in kinds
    blocks = {m.blocks.data_ptr(): m.blocks.numel() for m in kept.modules() if hasattr(m, "blocks")}
    assert VOCAB * HIDDEN * 34 // 32 < sum(blocks.values()) < path.stat().st_size
    gen = torch.Generator().manual_seed(3)
    for prompt_len in (1, 7, 19):
        ids = torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist()
        want, got = logits_of(fp32, ids), logits_of(kept, ids)
        assert (got - want).abs().max() <= 0.03 * want.abs().max()
        for _ in range(6):  # greedy, each step a fresh prefill of the whole sequence
            a, b = logits_of(fp32, ids)[-1].argmax().item(), logits_of(kept, ids)[-1].argmax()
            assert a == b.item()
            ids.append(int(a))


@pytest.mark.parametrize("quantization", ["gguf", "gguf+w8a8"])
def test_gguf_needs_a_gguf_file(tiny: tuple[Path, Path], quantization: str) -> None:
    with pytest.raises(ValueError, match="GGUF"):
        load_model(tiny[1], torch.float32, CPU, 128, quantization=quantization)
    with pytest.raises(ValueError, match="float32 activations"):  # nor bfloat16 activations
        load_model(tiny[1], torch.bfloat16, CPU, 128, quantization=quantization, gguf_path=tiny[0])


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_one_call_decode_over_gguf_blocks_matches_the_modules(
    tmp_path: Path, weight_type: str
) -> None:
    """Decode steps in one C call (`models/decode_step.py`) over the file's blocks give the
    tokens and logits of the same GGUF matmuls called module by module; a model with a matmul
    the step cannot run (a float q|k|v) keeps the modules."""
    from tests.parity import make_engine, record_logits, run_staggered
    from tests.tiny_gguf import build_gguf as build_tokenized_gguf

    path = build_tokenized_gguf(tmp_path / f"tiny.{weight_type}.gguf", weight_type)
    prompts = [[(3 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([4, 29, 61, 8])]
    runs = []
    for one_call in (True, False):
        engine = make_engine(path, quantization="gguf", kv_cache_dtype="bfloat16")
        assert engine.runner.model.kernels is not None
        engine.runner.model.one_call.enabled = one_call
        with record_logits(engine) as records:
            tokens = run_staggered(engine, prompts, max_tokens=20)
        assert (engine.runner.model.one_call.described is not None) == one_call
        runs.append((tokens, records))
    (tokens_one, logits_one), (tokens_modules, logits_modules) = runs
    assert tokens_one == tokens_modules
    errors = []
    for (ids_one, row_one), (ids_modules, row_modules) in zip(
        logits_one, logits_modules, strict=True
    ):
        assert ids_one == ids_modules
        errors.append(float((row_one - row_modules).abs().max() / row_modules.abs().max()))
    # SiLU's exp is C's here and PyTorch's there: float rounding apart, nothing more; where
    # that rounding moves an activation across an int8 step (blocks of 32 are quantized), one
    # row differs by that step, and the next rows do not carry it.
    assert sum(e <= 1e-4 for e in errors) >= 0.9 * len(errors), errors
    assert max(errors) <= 0.03, errors


def test_one_call_decode_keeps_the_modules_for_a_float_matmul(tiny: tuple[Path, Path]) -> None:
    """Layer 1's q|k|v is float in this file: the one-call step does not apply; with every
    matmul kept as blocks (the same file's layers otherwise) it does."""
    from modelyard.engine.models.decode_step import DecodeStep

    path, folder = tiny
    kept = load_model(folder, torch.float32, CPU, 128, quantization="gguf", gguf_path=path).model
    kernels = load_kernels(EngineSettings().cache_dir)
    assert kernels is not None
    kept.use_kernels(kernels)
    caches = [torch.zeros(2, 32, KV_HEADS, HIDDEN // 4) for _ in range(LAYERS)]
    assert DecodeStep.describe(kept, kernels, caches) is None
    layer1 = kept.model.layers[1].self_attn
    layer1.qkv_proj = kept.model.layers[0].self_attn.qkv_proj  # blocks, as the others
    assert DecodeStep.describe(kept, kernels, caches) is not None


# ----- gguf+w8a8: the blocks for narrow matmuls, a w8a8 copy for wide ones --------------------


def test_gguf_w8a8_layers_read_the_blocks_up_to_two_rows_and_their_copy_beyond(
    tiny: tuple[Path, Path],
) -> None:
    """Every kept matmul (the tied LM head too) holds its w8a8 copy; a matmul of up to
    `BLOCK_ROWS_MAX` rows is the blocks' own product, a wider one (or any without the C
    kernels) the copy's, exactly."""
    path, folder = tiny
    model = load_model(
        folder, torch.float32, CPU, 128, quantization="gguf+w8a8", gguf_path=path
    ).model
    kernels = load_kernels(EngineSettings().cache_dir)
    assert kernels is not None
    model.use_kernels(kernels)
    kept = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert len(kept) == 4 * LAYERS and model.lm_head in kept  # as under `gguf`
    assert all(isinstance(m.wide, Int8Linear) for m in kept)
    # layer 1's float q|k|v is w8a8 as a whole
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, Int8Linear)
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for layer in kept:
            assert layer.wide is not None
            for rows in range(1, BLOCK_ROWS_MAX + 3):
                x = torch.randn(rows, layer.in_features, generator=gen)
                bias = None if layer.bias is None else layer.bias.float()
                blocks = kernels.gguf_matmul(x, layer.blocks, layer.ggml_type, bias)
                want = blocks if rows <= BLOCK_ROWS_MAX else layer.wide(x)
                assert torch.equal(layer(x), want), rows
                assert not torch.equal(blocks, layer.wide(x))  # two different products
        model.use_kernels(None)
        x = torch.randn(1, kept[0].in_features, generator=gen)
        assert kept[0].wide is not None and torch.equal(kept[0](x), kept[0].wide(x))


def test_gguf_w8a8_decodes_narrow_steps_in_one_call_and_wide_ones_in_the_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the engine: decode steps of up to `BLOCK_ROWS_MAX` sequences run as one C call
    over the blocks, wider ones through the modules (on the w8a8 copies), and the tokens are
    those of the same engine with every step in the modules."""
    from modelyard.engine.models.decode_step import OneCallDecode
    from tests.parity import make_engine, run_staggered
    from tests.tiny_gguf import build_gguf as build_tokenized_gguf

    path = build_tokenized_gguf(tmp_path / "tiny.Q4_1.gguf", "Q4_1")
    lengths = [6, 23, 41, 9, 14, 30]  # six at once at the peak: more rows than the blocks take
    prompts = [[(5 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    steps: list[tuple[int, bool]] = []  # (decode rows, ran as one call)
    step_for = OneCallDecode.step_for

    def observed(self: OneCallDecode, lm: Any, kernels: Any, ids: Any, meta: Any, kv: Any) -> Any:
        step = step_for(self, lm, kernels, ids, meta, kv)
        if self.enabled and not meta.prefills:
            steps.append((int(ids.shape[0]), step is not None))
        return step

    monkeypatch.setattr(OneCallDecode, "step_for", observed)
    runs = []
    for one_call in (True, False):
        engine = make_engine(path, quantization="gguf+w8a8")
        engine.runner.model.one_call.enabled = one_call
        runs.append(run_staggered(engine, prompts, max_tokens=24, join_every=3))
    assert runs[0] == runs[1]
    assert {rows <= BLOCK_ROWS_MAX for rows, _ in steps} == {True, False}  # both kinds ran
    assert all(one_call == (rows <= BLOCK_ROWS_MAX) for rows, one_call in steps), steps
