"""The C decode-attention kernel (`engine/cpu_kernels.py`) against PyTorch's attention.

A property test draws batches of sequences with any context length, block size, head size and
grouped-query layout, their blocks scattered over the cache in any order, in float32 and
bfloat16, and checks the kernel's output against scaled-dot-product attention over the
gathered blocks (the path the engine takes without the kernel). Then the engine end to end:
the same staggered greedy run with the kernel on and off gives the same logits; and where the
kernel cannot be built, the engine still serves, through PyTorch.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelyard.config import EngineSettings
from modelyard.engine import cpu_kernels
from modelyard.engine.attention import gather_blocks
from tests.parity import make_engine, record_logits, run_staggered

KERNEL = cpu_kernels.load_decode_attention(EngineSettings().cache_dir)
pytestmark = pytest.mark.skipif(
    KERNEL is None, reason="no C compiler here: the engine runs decode attention in PyTorch"
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
    assert KERNEL is not None
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
    got = KERNEL(q, cache, tables, context, block_size, dim**-0.5)
    want = reference(q, cache, tables, context, block_size)
    torch.testing.assert_close(got, want, atol=2e-5 * max(1.0, spread), rtol=1e-4)


def test_engine_logits_match_with_and_without_the_kernel(tiny_llama: Path) -> None:
    prompts = [[(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([5, 40, 17, 90])]
    runs = []
    for use_kernel in (True, False):
        engine = make_engine(tiny_llama)
        if not use_kernel:
            engine.runner.decode_kernel = None
        else:
            assert engine.runner.decode_kernel is KERNEL  # on by default on CPU
        with record_logits(engine) as records:
            tokens = run_staggered(engine, prompts, max_tokens=24)
        runs.append((tokens, records))
    (tokens_on, logits_on), (tokens_off, logits_off) = runs
    assert tokens_on == tokens_off
    assert len(logits_on) == len(logits_off) > 4 * 20
    for (ids_on, row_on), (ids_off, row_off) in zip(logits_on, logits_off, strict=True):
        assert ids_on == ids_off
        torch.testing.assert_close(row_on, row_off, atol=1e-4, rtol=1e-4)


def test_without_a_compiler_the_engine_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, "modelyard.engine.cpu_kernels"):
        assert cpu_kernels.build_decode_attention(tmp_path) is None
    assert "did not build" in caplog.text and "PyTorch runs it" in caplog.text


def test_switched_off_the_engine_decodes_through_pytorch(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, cpu_kernels=False)
    assert engine.runner.decode_kernel is None
    prompts = [[5, 6, 7], [9] * 30]
    assert run_staggered(engine, prompts, max_tokens=8) == run_staggered(
        make_engine(tiny_llama), prompts, max_tokens=8
    )


def test_built_once_per_source_and_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = cpu_kernels._compiler()
    assert compiler is not None
    first = cpu_kernels._build(cpu_kernels.SOURCE, compiler, tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels._build(cpu_kernels.SOURCE, compiler, tmp_path) == first
    assert first.stat().st_mtime_ns == mtime  # cached, not rebuilt
    monkeypatch.setattr(cpu_kernels, "_OPTIMIZE", [*cpu_kernels._OPTIMIZE, "-O2"])
    assert cpu_kernels._build(cpu_kernels.SOURCE, compiler, tmp_path) != first


def test_long_work_split_over_threads_matches() -> None:
    assert KERNEL is not None
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
        got = KERNEL(q, cache, tables, context, block_size, dim**-0.5)
    finally:
        torch.set_num_threads(threads)
    want = reference(q, cache, tables, context, block_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
