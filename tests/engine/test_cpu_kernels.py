"""modelyard's C kernels (`engine/cpu_kernels.py`) against the PyTorch ops they replace.

A property test draws batches of sequences with any context length, block size, head size and
grouped-query layout, their blocks scattered over the cache in any order, in float32 and
bfloat16, and checks decode attention against scaled-dot-product attention over the gathered
blocks (the path the engine takes without the kernels); others check RMSNorm, RoPE with the KV
write and w8a8's activation scaling against the model's own PyTorch code. Then the engine end
to end: the same staggered greedy run with the kernels on and off gives the same logits, in
float32 and with w8a8; and where the kernels cannot be built, the engine still serves.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelyard.config import EngineSettings
from modelyard.engine import cpu_kernels, kernel_build
from modelyard.engine.attention import gather_blocks, write_kv
from modelyard.engine.models.config import ModelConfig
from modelyard.engine.models.llama import RMSNorm, RotaryEmbedding
from tests.parity import kernel_builds, make_engine, record_logits, run_staggered
from tests.tiny_models import build_model

KERNELS = cpu_kernels.load_kernels(EngineSettings().cache_dir)
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason="no C compiler here: the engine runs PyTorch's ops"
)


def reference(
    q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, bs: int
) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads = cache.shape[2]
    keys = gather_blocks(cache[0].float(), tables, bs).transpose(1, 2)
    values = gather_blocks(cache[1].float(), tables, bs).transpose(1, 2)
    mask = torch.arange(tables.shape[1] * bs) < lengths[:, None]
    grouped = q.view(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(
        grouped, keys, values, attn_mask=mask.view(batch, 1, 1, -1), scale=dim**-0.5
    )
    return out.reshape(batch, heads, dim)


@settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    lengths=st.lists(st.integers(1, 90), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 3, 16]),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    dim=st.sampled_from([8, 64, 80, 128]),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
    spread=st.floats(0.1, 30.0),
)
def test_matches_attention_over_gathered_blocks(
    lengths: list[int],
    block_size: int,
    kv_heads: int,
    group: int,
    dim: int,
    bf16: bool,
    seed: int,
    spread: float,
) -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lengths) // block_size)
    num_blocks = len(lengths) * max_blocks + 3
    dtype = torch.bfloat16 if bf16 else torch.float32
    # `spread` scales the keys: large values give peaked softmaxes (tiny weights underflow).
    cache = (torch.randn(2, num_blocks * block_size, kv_heads, dim, generator=gen) * spread).to(
        dtype
    )
    # Each sequence its own blocks, scattered over the cache in any order.
    order = torch.randperm(num_blocks, generator=gen)[: len(lengths) * max_blocks]
    tables = order.view(len(lengths), max_blocks).contiguous()
    q = torch.randn(len(lengths), kv_heads * group, dim, generator=gen)
    context = torch.tensor(lengths, dtype=torch.long)
    got = KERNELS.decode_attention(q, cache, tables, context, block_size, dim**-0.5)
    want = reference(q, cache, tables, context, block_size)
    torch.testing.assert_close(got, want, atol=2e-5 * max(1.0, spread), rtol=1e-4)


Records = list[tuple[list[int], torch.Tensor]]


def same_with_and_without_kernels(
    folder: Path,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    atol_of_max: float | None = None,
    **settings: Any,
) -> Records:
    """Run the prompts staggered in an engine with the C kernels (on by default) and in one
    without; check both give the same tokens and logits (to 1e-4, or to `atol_of_max` times a
    row's largest logit); return the first's logits."""
    runs = []
    for use_kernels in (True, False):
        engine = make_engine(folder, **settings)
        assert isinstance(engine.runner.kernels, cpu_kernels.CpuKernels)
        if not use_kernels:
            engine.runner.use_kernels(None)
        with record_logits(engine) as records:
            tokens = run_staggered(engine, prompts, max_tokens)
        runs.append((tokens, records))
    (tokens_on, logits_on), (tokens_off, logits_off) = runs
    assert tokens_on == tokens_off
    assert len(logits_on) == len(logits_off) >= len(prompts) * max_tokens
    for (ids_on, row_on), (ids_off, row_off) in zip(logits_on, logits_off, strict=True):
        assert ids_on == ids_off
        if atol_of_max is None:
            torch.testing.assert_close(row_on, row_off, atol=1e-4, rtol=1e-4)
        else:
            atol = atol_of_max * row_off.abs().max().item()
            torch.testing.assert_close(row_on, row_off, atol=atol, rtol=0)
    return logits_on


def test_engine_logits_match_with_and_without_the_kernels(tiny_llama: Path) -> None:
    prompts = [[(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([5, 40, 17, 90])]
    same_with_and_without_kernels(tiny_llama, prompts, max_tokens=24)


def test_without_a_compiler_the_engine_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, "modelyard.engine.cpu_kernels"):
        assert cpu_kernels.build_kernels(tmp_path) is None
    assert "did not build" in caplog.text and "PyTorch runs their ops" in caplog.text


def test_switched_off_the_engine_decodes_through_pytorch(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, cpu_kernels=False)
    assert engine.runner.kernels is None
    prompts = [[5, 6, 7], [9] * 30]
    assert run_staggered(engine, prompts, max_tokens=8) == run_staggered(
        make_engine(tiny_llama), prompts, max_tokens=8
    )


def test_built_once_per_source_and_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = kernel_build.compiler()
    assert compiler is not None
    first = kernel_build.build(kernel_build.SOURCES, compiler, tmp_path)
    mtime = first.stat().st_mtime_ns
    assert kernel_build.build(kernel_build.SOURCES, compiler, tmp_path) == first
    assert first.stat().st_mtime_ns == mtime  # cached, not rebuilt
    monkeypatch.setattr(kernel_build, "OPTIMIZE", [*kernel_build.OPTIMIZE, "-O2"])
    assert kernel_build.build(kernel_build.SOURCES, compiler, tmp_path) != first


def test_long_work_split_over_threads_matches() -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(1)
    lengths, block_size, kv_heads, heads, dim = [1500, 2000, 900, 1800], 16, 2, 8, 128
    max_blocks = -(-max(lengths) // block_size)
    cache = torch.randn(2, len(lengths) * max_blocks * block_size, kv_heads, dim, generator=gen)
    tables = torch.randperm(len(lengths) * max_blocks, generator=gen).view(len(lengths), -1)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    context = torch.tensor(lengths)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # ~24M multiply-adds: three threads of ~8M
    try:
        got = KERNELS.decode_attention(q, cache, tables, context, block_size, dim**-0.5)
    finally:
        torch.set_num_threads(threads)
    want = reference(q, cache, tables, context, block_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rows=st.integers(1, 40), cols=st.sampled_from([8, 64, 576]), seed=st.integers(0, 999))
def test_rms_norm_matches_the_model(rows: int, cols: int, seed: int) -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(cols, 1e-5)
    norm.weight.data = torch.randn(cols, generator=gen)
    x = torch.randn(rows, cols + 5, generator=gen)[:, :cols] * 10  # rows strided
    want = norm(x)
    norm.kernels = KERNELS
    torch.testing.assert_close(norm(x), want)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    tokens=st.integers(1, 20),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    dim=st.sampled_from([8, 64]),
    seed=st.integers(0, 999),
)
def test_rope_and_kv_write_match_the_model(
    tokens: int, kv_heads: int, group: int, dim: int, seed: int
) -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(seed)
    cfg = ModelConfig.from_hf_dict(
        {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": kv_heads * group,
            "num_key_value_heads": kv_heads,
            "head_dim": dim,
            "vocab_size": 64,
            "max_position_embeddings": 300,
        }
    )
    rope = RotaryEmbedding(cfg, 300)
    heads = kv_heads * group
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    slots = torch.randperm(64, generator=gen)[:tokens]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q, want_k = rope(
        positions, q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim)
    )
    want_cache = torch.zeros(2, 64, kv_heads, dim)
    write_kv(want_cache, slots, want_k, v.reshape(tokens, kv_heads, dim))
    bf16_qkv = qkv.clone()
    cache = torch.zeros(2, 64, kv_heads, dim)
    KERNELS.rope_write_kv(qkv, rope.cos, rope.sin, positions, slots, cache, heads)
    torch.testing.assert_close(qkv[:, : heads * dim].reshape(tokens, heads, dim), want_q)
    torch.testing.assert_close(cache, want_cache)
    # A bfloat16 cache holds PyTorch's own rounding of the same keys and values.
    bf16_cache = torch.zeros(2, 64, kv_heads, dim, dtype=torch.bfloat16)
    KERNELS.rope_write_kv(bf16_qkv, rope.cos, rope.sin, positions, slots, bf16_cache, heads)
    want_bf16 = torch.zeros(2, 64, kv_heads, dim, dtype=torch.bfloat16)
    write_kv(want_bf16, slots, want_k, v.reshape(tokens, kv_heads, dim))
    assert torch.equal(bf16_cache, want_bf16)
    with pytest.raises(IndexError, match="RoPE table"):
        KERNELS.rope_write_kv(qkv, rope.cos, rope.sin, positions + 300, slots, cache, heads)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.integers(2, 16), smooth=st.booleans(), seed=st.integers(0, 999))
def test_w8a8_activation_scaling_matches(rows: int, smooth: bool, seed: int) -> None:
    """FBGEMM's w8a8 path (no VNNI here, or a batch the C matmul does not take) scales each row
    in C exactly as in PyTorch."""
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=gen) * 5
    x[0] = 0.0  # an all-zero row keeps its floor scale
    inv_smooth = 1.0 / (torch.rand(64, generator=gen) * 3 + 0.1) if smooth else None
    scaled = x if inv_smooth is None else x * inv_smooth
    row_max = scaled.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    out, got_max = KERNELS.smooth_rows(x, inv_smooth)
    assert torch.equal(got_max, row_max) and torch.equal(out, scaled / row_max)


def exact_int8_product(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The C matmul's arithmetic in PyTorch: x quantized per row (round half away from zero),
    the integer products summed exactly (float64), then the scales."""
    amax = x.abs().amax(dim=1, keepdim=True)
    v = x * torch.where(amax > 0, 127.0 / amax, 0.0)
    xq = torch.sign(v) * torch.floor(v.abs() + 0.5)
    acc = (xq.double() @ q.double().T).float()
    y = acc * (amax / 127.0) * scale
    return y if bias is None else y + bias


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 11),
    k=st.sampled_from([8, 63, 64, 65, 576, 1000]),
    n=st.sampled_from([1, 4, 6, 37, 576, 2000]),
    smooth=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 999),
    build=st.sampled_from(sorted(kernel_builds())),
)
def test_int8_matmul_matches_its_integer_arithmetic(
    rows: int, k: int, n: int, smooth: bool, bias: bool, seed: int, build: str
) -> None:
    """Every batch size, K not a multiple of the 64-byte vector, N not a multiple of the 4-row
    block, over the threads the process may use (chunks claimed dynamically); the VNNI and the
    plain-C build."""
    kernels = kernel_builds()[build]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) / 100
    x = torch.randn(rows, k, generator=gen) * 3
    x[0, : k // 2] = 0.0
    inv_smooth = torch.rand(k, generator=gen) + 0.5 if smooth else None
    b = torch.randn(n, generator=gen) if bias else None
    got = kernels.int8_matmul(x, q, q.sum(dim=1, dtype=torch.int32), scale, b, inv_smooth)
    want = exact_int8_product(x if inv_smooth is None else x * inv_smooth, q, scale, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_int8_matmul_from_two_threads_at_once() -> None:
    """Two engines in one process may step at the same time: their calls take turns on the
    thread pool (ctypes releases the GIL), and each gets its own product."""
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (3000, 512), dtype=torch.int8, generator=gen)
    sums, scale = q.sum(dim=1, dtype=torch.int32), torch.rand(3000, generator=gen) / 100
    inputs = [torch.randn(rows, 512, generator=gen) for rows in (1, 3, 8, 17)]
    want = [KERNELS.int8_matmul(x, q, sums, scale, None, None) for x in inputs]

    def run(offset: int) -> bool:
        return all(
            torch.equal(KERNELS.int8_matmul(inputs[i], q, sums, scale, None, None), want[i])
            for n in range(60)
            for i in [(n + offset) % len(inputs)]
        )

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(run, [0, 1]))


def test_w8a8_engine_logits_match_with_and_without_kernels(tiny_llama: Path) -> None:
    """Where the C matmul runs (VNNI), w8a8 quantizes activations with 8 symmetric bits per
    token instead of FBGEMM's 7-bit asymmetric ones: the logits differ by a quantization's
    error, so both are held to float32's and the C path must be no further from them;
    elsewhere the C path is PyTorch's, exactly."""
    assert KERNELS is not None
    prompts = [[(5 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([6, 33, 70])]
    if not KERNELS.int8_matmul_vectorized:
        same_with_and_without_kernels(tiny_llama, prompts, max_tokens=16, quantization="w8a8")
        return
    firsts = []
    for quantization, use_kernels in (("w8a8", True), ("w8a8", False), (None, True)):
        engine = make_engine(tiny_llama, quantization=quantization)
        engine.runner.use_kernels(KERNELS if use_kernels else None)
        if quantization:
            layer = engine.runner.model.model.layers[0].mlp.down_proj
            assert (layer.packed is None) == use_kernels  # one form of the weights at a time
        with record_logits(engine) as records:
            run_staggered(engine, prompts, max_tokens=1)
        firsts.append(torch.stack([row for _, row in records]))
    c_matmul, fbgemm, float32 = (
        (f - firsts[2]).abs().max() / firsts[2].abs().max() for f in firsts
    )
    print(f"w8a8 logits' error against float32: C {c_matmul:.4f}, FBGEMM {fbgemm:.4f}")
    assert float32 == 0 and 0 < c_matmul <= fbgemm


ONE_CALL_VARIANTS = {
    "llama-f32-kv": ("llama", {}, "float32"),
    "llama-bf16-kv": ("llama", {}, "bfloat16"),
    "qwen2-bias": ("qwen2", {}, "float32"),  # q/k/v biases through the C matmul
    "llama-mqa": ("llama", {"num_key_value_heads": 1}, "bfloat16"),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 32}, "float32"),  # not one call: per-head norms
}


@pytest.mark.parametrize("variant", sorted(ONE_CALL_VARIANTS))
def test_one_call_decode_matches_the_modules(tmp_path: Path, variant: str) -> None:
    """w8a8 decode steps in one C call (`models/decode_step.py`) give the tokens and logits of
    the same kernels called layer by layer from the modules; a model it does not fit (per-head
    q/k norms) keeps the modules."""
    assert KERNELS is not None
    if not KERNELS.int8_matmul_vectorized:
        pytest.skip("no AVX-512 VNNI here: w8a8 runs FBGEMM's matmul, and steps the modules")
    model_type, overrides, kv_cache_dtype = ONE_CALL_VARIANTS[variant]
    folder = build_model(tmp_path / "m", model_type, **overrides)
    applies = model_type != "qwen3"
    prompts = [[(3 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([4, 29, 61, 8])]
    runs = []
    for one_call in (True, False):
        engine = make_engine(folder, quantization="w8a8", kv_cache_dtype=kv_cache_dtype)
        engine.runner.model.one_call.enabled = one_call
        with record_logits(engine) as records:
            tokens = run_staggered(engine, prompts, max_tokens=20)
        assert (engine.runner.model.one_call.described is not None) == (one_call and applies)
        runs.append((tokens, records))
    (tokens_one, logits_one), (tokens_modules, logits_modules) = runs
    assert tokens_one == tokens_modules
    for (ids_one, row_one), (ids_modules, row_modules) in zip(
        logits_one, logits_modules, strict=True
    ):
        assert ids_one == ids_modules
        # SiLU's exp is C's here and PyTorch's there: float rounding apart, nothing more.
        torch.testing.assert_close(row_one, row_modules, atol=1e-3, rtol=1e-3)


def test_bfloat16_kv_cache_under_a_float32_model(tiny_llama: Path) -> None:
    """`kv_cache_dtype: bfloat16` halves the cache and keeps the float32 model's outputs close;
    the C kernels and PyTorch's ops read and write it alike."""
    prompts = [[(3 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([9, 50, 21])]
    full = make_engine(tiny_llama)
    with record_logits(full) as reference:
        run_staggered(full, prompts, max_tokens=12)
    engine = make_engine(tiny_llama, kv_cache_dtype="bfloat16")
    assert engine.runner.kv_caches[0].dtype == torch.bfloat16
    assert engine.runner.model.model.norm.weight.dtype == torch.float32
    # Same memory budget, half the bytes per token: twice the blocks.
    assert engine.kv.num_blocks >= 2 * full.kv.num_blocks - 1
    # Kernels and PyTorch compute K and V in a different order (FMA contraction differs with
    # the CPU's vector width): a last-bit difference before the rounding to bfloat16 can land
    # on the other side of a rounding boundary, a change of 2^-8 in that element. So the two
    # paths agree to a bfloat16 rounding step, not to float32's.
    logits_on = same_with_and_without_kernels(
        tiny_llama, prompts, max_tokens=12, kv_cache_dtype="bfloat16", atol_of_max=0.01
    )
    by_context = {tuple(t): row for t, row in reference}
    pairs = [(row, by_context[tuple(t)]) for t, row in logits_on if tuple(t) in by_context]
    assert len(pairs) >= len(prompts)
    for row, ref in pairs:  # bfloat16's rounding of K and V: close, not equal
        torch.testing.assert_close(row, ref, atol=0.05 * ref.abs().max().item(), rtol=0)
