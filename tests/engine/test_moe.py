"""Mixture-of-experts models (Mixtral, Qwen2-MoE, OLMoE) against transformers on the same random
weights: logits of prefill and decode steps and greedy tokens, through the real engine with
several sequences of different lengths in a batch; each expert runs once per layer per step over
the tokens routed to it; what the engine does not implement for MoE is refused at load."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from modelyard.engine.models.config import ModelConfig, MoeConfig, UnsupportedModelError
from modelyard.engine.models.mlp import MLP
from modelyard.engine.models.moe import SparseMoeBlock, checkpoint_name
from tests.engine.test_model_parity import prompts
from tests.parity import hf_greedy, hf_logits, make_engine, record_logits, run_staggered
from tests.tiny_models import build_model

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    # layer 0 dense (mlp_only_layers), layers 1-2 sparse with the shared expert
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [0],
        },
    ),
    # every other layer sparse, top-k renormalised, four experts per token
    "qwen2_moe-step2": (
        "qwen2_moe",
        {
            "num_hidden_layers": 4,
            "num_experts": 6,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 2,
            "norm_topk_prob": True,
            "qkv_bias": False,
        },
    ),
    "olmoe": ("olmoe", {"num_experts": 8, "num_experts_per_tok": 2}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, overrides = VARIANTS[request.param]
    return build_model(tmp_path_factory.mktemp(request.param) / "m", model_type, **overrides)


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, overrides = VARIANTS["mixtral"]
    return build_model(tmp_path_factory.mktemp("mixtral") / "m", model_type, **overrides)


def test_logits_match_transformers(variant: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(variant, dtype=torch.float32).eval()
    engine = make_engine(variant, block_size=4)
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in engine.runner.model.model.layers)
    with record_logits(engine) as records:
        run_staggered(engine, prompts(4), max_tokens=6, join_every=1)
    assert len(records) == 4 * 6  # each sequence's prefill and five decode steps
    for tokens, logits in records:
        ref = hf_logits(hf, tokens)
        assert torch.allclose(logits, ref, atol=1e-4, rtol=0), (logits - ref).abs().max()


def test_greedy_is_token_identical_alone_and_batched(variant: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(variant, dtype=torch.float32).eval()
    ps = prompts(6)
    expected = {i: hf_greedy(hf, p, 16) for i, p in enumerate(ps)}
    alone = make_engine(variant)
    assert run_staggered(alone, ps[:1], 16) == {0: expected[0]}
    together = make_engine(variant, block_size=4)
    assert run_staggered(together, ps, 16, join_every=2) == expected


def test_without_the_c_kernels_too(tiny_mixtral: Path, tmp_path: Path) -> None:
    olmoe = build_model(tmp_path / "olmoe", "olmoe", num_experts=4, num_experts_per_tok=2)
    for folder in (tiny_mixtral, olmoe):
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        engine = make_engine(folder, block_size=4, cpu_kernels=False)
        with record_logits(engine) as records:
            run_staggered(engine, prompts(3), max_tokens=3, join_every=1)
        for tokens, logits in records:
            assert torch.allclose(logits, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_each_expert_runs_once_a_step_on_tokens_of_several_sequences(tiny_mixtral: Path) -> None:
    engine = make_engine(tiny_mixtral, block_size=4)
    calls: Counter[int] = Counter()  # id(expert) -> calls this step
    rows: list[int] = []  # rows each call got this step

    def count(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        calls[id(module)] += 1
        rows.append(args[0].shape[0])

    layers = engine.runner.model.model.layers
    for layer in layers:
        for expert in layer.mlp.experts:
            expert.register_forward_pre_hook(count)
    for i, p in enumerate(prompts(8)):
        engine.add_request(str(i), p, _greedy(4))
    decode_steps = 0
    while engine.has_unfinished():
        calls.clear()
        rows.clear()
        engine.step()
        assert calls and max(calls.values()) == 1
        if sum(rows) == 8 * 2 * len(layers):  # eight sequences' one-token decodes, top-2
            decode_steps += 1
            assert max(rows) > 1  # some expert's group holds tokens of several sequences
    assert decode_steps == 3


def _greedy(n: int) -> Any:
    from modelyard.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_batched_experts_equal_each_token_through_its_experts() -> None:
    torch.manual_seed(0)
    moe = MoeConfig(
        num_experts=5,
        top_k=2,
        intermediate_size=24,
        norm_topk_prob=False,
        shared_expert_intermediate_size=16,
    )
    block = SparseMoeBlock(16, moe).eval()
    x = torch.randn(11, 16)
    with torch.no_grad():
        got = block(x)
        block.fuse()
        fused = block(x)
        want = torch.zeros_like(x)
        probs = torch.softmax(block.gate(x), dim=-1)
        experts: list[MLP] = block.expert_mlps()
        assert block.shared_expert is not None and block.shared_expert_gate is not None
        for t in range(x.shape[0]):
            weights, chosen = probs[t].topk(2)
            for w, e in zip(weights, chosen.tolist(), strict=True):
                want[t] += w * experts[e](x[t : t + 1])[0]
            gate = torch.sigmoid(block.shared_expert_gate(x[t]))
            want[t] += gate * block.shared_expert(x[t : t + 1])[0]
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(fused, want, atol=1e-5)


def test_mixtral_checkpoint_names() -> None:
    assert (
        checkpoint_name("model.layers.3.block_sparse_moe.experts.12.w1.weight")
        == "model.layers.3.mlp.experts.12.gate_proj.weight"
    )
    assert checkpoint_name("model.layers.0.block_sparse_moe.experts.0.w2.weight").endswith(
        "mlp.experts.0.down_proj.weight"
    )
    assert checkpoint_name("model.layers.0.block_sparse_moe.experts.7.w3.weight").endswith(
        "mlp.experts.7.up_proj.weight"
    )
    assert checkpoint_name("model.layers.0.block_sparse_moe.gate.weight").endswith(
        "mlp.gate.weight"
    )
    assert checkpoint_name("model.layers.0.mlp.gate_proj.weight") == (
        "model.layers.0.mlp.gate_proj.weight"
    )


def _qwen2_moe(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "qwen2_moe",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
    }
    cfg.update(overrides)
    return cfg


def test_config_sparse_layers_and_refusals() -> None:
    cfg = ModelConfig.from_hf_dict(_qwen2_moe(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.moe is not None and cfg.attention_bias  # Qwen2-MoE's qkv_bias defaults on
    assert [cfg.moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    assert ModelConfig.from_hf_dict(_qwen2_moe(qkv_bias=False)).attention_bias is False
    with pytest.raises(UnsupportedModelError, match="decoder_sparse_step"):
        ModelConfig.from_hf_dict(_qwen2_moe(decoder_sparse_step=0))
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict(_qwen2_moe(num_experts_per_tok=9))
    olmoe = _qwen2_moe(model_type="olmoe")
    assert ModelConfig.from_hf_dict(olmoe).qk_norm_whole
    with pytest.raises(UnsupportedModelError, match="clip_qkv"):
        ModelConfig.from_hf_dict({**olmoe, "clip_qkv": 8.0})
    assert ModelConfig.from_hf_dict({**olmoe, "model_type": "llama"}).moe is None


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"quantization": "int8"}, "quantization='int8'"),
        ({"quantization": "w8a8"}, "quantization='w8a8'"),
        ({"max_loras": 2}, "LoRA"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
    ],
)
def test_refused_with_moe_at_load(tiny_mixtral: Path, settings: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts") as err:
        make_engine(tiny_mixtral, **settings)
    assert named in str(err.value)
