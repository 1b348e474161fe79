"""The gated SiLU MLP of the Llama family (`down(silu(gate(x)) * up(x))`), and the helpers the
decoder's projections share: fusing linears into one matmul, the tensor-parallel all-reduce.

A dense decoder layer has one; a mixture-of-experts layer (`moe.py`) has one per expert and
possibly a shared one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def fused_linear(parts: tuple[nn.Linear, ...]) -> nn.Linear:
    """One linear layer whose output is the concatenation of `parts`' outputs."""
    out_features = sum(p.out_features for p in parts)
    has_bias = parts[0].bias is not None
    fused = nn.Linear(parts[0].in_features, out_features, bias=has_bias, device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum the row-parallel partial outputs of every tensor-parallel rank (in place)."""
    dist.all_reduce(x)
    return x


class MLP(nn.Module):
    """`intermediate` is this rank's share of the intermediate size (all of it with one rank)."""

    def __init__(self, hidden_size: int, intermediate: int, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.intermediate = intermediate
        self.gate_proj = nn.Linear(hidden_size, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        self.gate_up_proj = fused_linear((self.gate_proj, self.up_proj))
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out = self.down_proj(F.silu(gate) * up)
        return all_reduce(out) if self.tp_size > 1 else out
