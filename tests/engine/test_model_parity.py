"""The engine against transformers on the same random weights: logits and greedy tokens, for
each supported architecture, alone and batched with staggered joins, chunking and preemption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.parity import hf_greedy, hf_logits, make_engine, record_logits, run_staggered
from tests.tiny_models import build_model

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama3-rope-tied": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, overrides = VARIANTS[request.param]
    return build_model(tmp_path_factory.mktemp(request.param) / "m", model_type, **overrides)


def prompts(n: int = 8, vocab: int = 380, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 41, 17, 3, 30, 12, 64, 21][:n]
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def test_logits_match_transformers(variant: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(variant, dtype=torch.float32).eval()
    engine = make_engine(variant, block_size=4)
    with record_logits(engine) as records:
        run_staggered(engine, prompts(4), max_tokens=6)
    assert len(records) == 4 * 6
    for tokens, logits in records:
        ref = hf_logits(hf, tokens)
        assert torch.allclose(logits, ref, atol=1e-4, rtol=0), (logits - ref).abs().max()


def test_greedy_is_token_identical_alone_and_batched(variant: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(variant, dtype=torch.float32).eval()
    ps = prompts()
    expected = {i: hf_greedy(hf, p, 32) for i, p in enumerate(ps)}
    alone = make_engine(variant)
    assert run_staggered(alone, ps[:1], 32) == {0: expected[0]}
    together = make_engine(variant, block_size=4)
    assert run_staggered(together, ps, 32, join_every=3) == expected


def test_greedy_survives_chunked_prefill_and_preemption(tiny_llama: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ps = prompts()
    expected = {i: hf_greedy(hf, p, 32) for i, p in enumerate(ps)}
    # 2 layers * 2 (K,V) * 2 kv heads * 16 dims * 4 bytes = 512 bytes a token; 40 blocks of 4.
    engine = make_engine(
        tiny_llama, block_size=4, kv_cache_memory=512 * 4 * 40, max_num_batched_tokens=16
    )
    assert run_staggered(engine, ps, 32, join_every=2) == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.pool.num_free == engine.kv.num_blocks  # everything given back


def test_bfloat16_logits_stay_close(tiny_llama: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    engine = make_engine(tiny_llama, dtype="bfloat16", block_size=4)
    assert engine.runner.kv_caches[0].dtype == torch.bfloat16
    with record_logits(engine) as records:
        run_staggered(engine, prompts(2), max_tokens=4)
    for tokens, logits in records:
        ref = hf_logits(hf, tokens)
        assert (logits - ref).abs().max() < 0.05 * ref.abs().max()
