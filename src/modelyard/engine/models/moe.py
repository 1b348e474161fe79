"""The sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, OLMoE) over a flat token batch.

A linear router scores every expert for each token; the token goes to its `top_k` experts by
softmax probability (renormalised over those `top_k` where the model says so), and its output is
their outputs weighted by those probabilities; Qwen2-MoE adds a shared expert that every token
goes through, scaled by `sigmoid(shared_expert_gate(x))`.

Experts run batched per step: the step's (token, expert) pairs are sorted by expert, the tokens
gathered once in that order, each expert's MLP runs once over its contiguous group, and the
weighted outputs are scatter-added back to their tokens.

Parameter names follow Qwen2-MoE's and OLMoE's checkpoints (`mlp.gate`, `mlp.experts.N.
gate_proj/up_proj/down_proj`, `mlp.shared_expert.*`, `mlp.shared_expert_gate`); Mixtral's
(`block_sparse_moe.experts.N.w1/w2/w3`) are renamed to them as they load (`checkpoint_name`).
Tensor parallelism, quantization and LoRA are not implemented for these layers and are refused
(`check_moe_features`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from modelyard.engine.models.config import ModelConfig, MoeConfig, UnsupportedModelError
from modelyard.engine.models.mlp import MLP

_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def checkpoint_name(name: str) -> str:
    """The engine's name for checkpoint tensor `name` (Mixtral's MoE names renamed)."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m[1]}.{_MIXTRAL_PROJ[m[2]]}.", name)


def check_moe_features(
    cfg: ModelConfig, tp_size: int = 1, quantization: str | None = None, max_loras: int = 0
) -> None:
    """Raise `UnsupportedModelError` naming what a mixture-of-experts model is asked to run
    with that the engine does not implement for its expert layers."""
    if cfg.moe is None:
        return
    refused = []
    if tp_size > 1:
        refused.append(f"tensor_parallel_size={tp_size}")
    if quantization is not None:
        refused.append(f"quantization={quantization!r}")
    if max_loras:
        refused.append(f"LoRA adapters (max_loras={max_loras})")
    if refused:
        raise UnsupportedModelError(
            f"{', '.join(refused)}: not supported with mixture-of-experts models "
            f"({cfg.model_type}); serve it unquantized on one rank without LoRA"
        )


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            MLP(hidden_size, moe.intermediate_size) for _ in range(moe.num_experts)
        )
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = MLP(hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared else None

    def expert_mlps(self) -> list[MLP]:
        return [e for e in self.experts if isinstance(e, MLP)]

    def fuse(self) -> None:
        for expert in self.expert_mlps():
            expert.fuse()
        if self.shared_expert is not None:
            self.shared_expert.fuse()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts `[T, top_k]` and their weights (in `x`'s dtype)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        # The (token, expert) pairs sorted by expert: each expert's tokens one contiguous group.
        pairs = experts.reshape(-1)
        order = torch.argsort(pairs, stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(pairs, minlength=self.num_experts).tolist()
        grouped = x.index_select(0, tokens)
        outputs = []
        start = 0
        for expert, count in zip(self.expert_mlps(), counts, strict=True):
            if count:
                outputs.append(expert(grouped[start : start + count]))
                start += count
        weighted = torch.cat(outputs) * weights.reshape(-1, 1).index_select(0, order)
        out = torch.zeros_like(x).index_add_(0, tokens, weighted)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
