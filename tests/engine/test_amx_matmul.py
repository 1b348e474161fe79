"""The w8a8 matmul on AMX tiles (`csrc/amx_matmul.c`): the same int32 sums as the AVX-512 VNNI
product for every row count and shape, the weights' tile order made only where it applies, and
an engine's decode steps through it giving the VNNI steps' tokens and logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelyard.config import EngineSettings
from modelyard.engine import cpu_kernels
from modelyard.engine.quantization import Int8Linear, weight_bytes
from tests.parity import make_engine, record_logits, run_staggered

KERNELS = cpu_kernels.load_kernels(EngineSettings().cache_dir)
needs_amx = pytest.mark.skipif(
    KERNELS is None or not KERNELS.int8_amx, reason="no AMX tiles on this CPU (or not granted)"
)


def _product(
    x: torch.Tensor, w: torch.Tensor, amx: bool, bias: torch.Tensor | None, smooth: torch.Tensor
) -> torch.Tensor:
    assert KERNELS is not None
    scale = torch.linspace(0.5, 2.0, w.shape[0])
    sums = w.sum(dim=1, dtype=torch.int32)
    packed = KERNELS.amx_pack(w) if amx else None
    assert (packed is not None) == amx
    return KERNELS.int8_matmul(x, w, sums, scale, bias, smooth, packed)


@needs_amx
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 70),
    tiles=st.integers(1, 7),  # output channels: 16 each (odd counts: a lone last tile)
    chunks=st.integers(1, 4),  # inputs: 64 each
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_amx_product_equals_vnni(
    rows: int, tiles: int, chunks: int, with_bias: bool, seed: int
) -> None:
    """Every row count (partial 16-row tiles, one or two x-tiles a pass, several passes) and an
    odd number of channel tiles: the AMX product's int32 sums are the VNNI product's, so the
    outputs differ at most by the float scaling's last bit."""
    g = torch.Generator().manual_seed(seed)
    n, k = 16 * tiles, 64 * chunks
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    x = torch.randn(rows, k, generator=g) * 3
    bias = torch.randn(n, generator=g) if with_bias else None
    smooth = torch.rand(k, generator=g) + 0.5
    amx, vnni = (_product(x, w, on, bias, smooth) for on in (True, False))
    ulps = (amx - vnni).abs() / torch.finfo(torch.float32).eps
    assert (ulps <= 4 * vnni.abs().clamp(min=1.0)).all()


@needs_amx
def test_amx_pack_only_where_the_tiles_fit() -> None:
    """Channels must come in 16s and inputs in 64s; other layers keep the VNNI product."""
    assert KERNELS is not None
    assert KERNELS.amx_pack(torch.zeros(48, 128, dtype=torch.int8)) is not None
    assert KERNELS.amx_pack(torch.zeros(40, 128, dtype=torch.int8)) is None
    assert KERNELS.amx_pack(torch.zeros(48, 96, dtype=torch.int8)) is None


@needs_amx
def test_amx_copy_is_kept_and_counted() -> None:
    """A w8a8 layer under the C kernels keeps its AMX copy beside its rows, and `weight_bytes`
    counts it (the KV cache is sized from what is left)."""
    layer = Int8Linear.from_weight(torch.randn(64, 128), None, torch.float32, "fbgemm")
    layer.kernels = KERNELS
    assert layer.amx_weight is not None and layer.qweight is not None
    assert weight_bytes(layer) >= 2 * 64 * 128
    layer.kernels = None  # FBGEMM's packed copy instead: no AMX copy left behind
    assert layer.amx_weight is None and layer.packed is not None


@needs_amx
def test_engine_decode_through_amx_matches_vnni(tiny_llama: Path) -> None:
    """Ten sequences decoding together (steps of 8+ rows run on the tiles, in the one-call C
    step and in the modules' prefill) give the tokens of the same engine without the AMX
    copies, and logits within float rounding."""
    prompts = [[(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate(range(5, 45, 4))]
    runs = []
    for amx in (True, False):
        engine = make_engine(tiny_llama, quantization="w8a8")
        layers = [m for m in engine.runner.model.modules() if isinstance(m, Int8Linear)]
        assert all(m.amx_weight is not None for m in layers[:-1])  # every decoder matmul
        if not amx:
            for m in layers:
                m.amx_weight = None
            engine.runner.model.one_call.forget()
        with record_logits(engine) as records:
            tokens = run_staggered(engine, prompts, max_tokens=12, join_every=1)
        assert engine.runner.model.one_call.described is not None
        runs.append((tokens, records))
    (tokens_amx, logits_amx), (tokens_vnni, logits_vnni) = runs
    assert tokens_amx == tokens_vnni
    for (ids_amx, row_amx), (ids_vnni, row_vnni) in zip(logits_amx, logits_vnni, strict=True):
        assert ids_amx == ids_vnni
        torch.testing.assert_close(row_amx, row_vnni, atol=1e-4, rtol=1e-4)
