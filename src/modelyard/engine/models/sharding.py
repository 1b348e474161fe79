"""Megatron-style tensor-parallel shards of the Llama family, by Hugging Face parameter name.

Column-parallel (each rank keeps a contiguous slice of output rows): q/k/v (whole heads; with
grouped-query attention rank r keeps KV heads `[r, r+1) * kv_heads / tp` and exactly the query
heads that attend to them), gate/up (a slice of the intermediate size), and the q/k/v biases with
their rows. Row-parallel (a slice of input columns, the partial outputs summed by an all-reduce):
o_proj and down_proj. Everything else (embeddings, norms, Qwen3's per-head q/k norms, LM head) is
replicated.
"""

from __future__ import annotations

from modelyard.engine.models.config import ModelConfig, UnsupportedModelError

# (dim, start, end): keep `tensor.narrow(dim, start, end - start)` on this rank.
Slice = tuple[int, int, int]


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raise `UnsupportedModelError` unless every rank gets an equal, whole share of the model."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
    if tp == 1:
        return
    numbers = {
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
    }
    bad = [f"{name}={value}" for name, value in numbers.items() if value % tp]
    if bad:
        raise UnsupportedModelError(
            f"tensor_parallel_size={tp} does not divide this model's {', '.join(bad)}: each rank "
            "needs a whole, equal share of num_attention_heads "
            f"({cfg.num_attention_heads}), num_key_value_heads ({cfg.num_key_value_heads}) and "
            f"intermediate_size ({cfg.intermediate_size}); use a tensor_parallel_size that "
            "divides all three"
        )


def shard_slice(name: str, cfg: ModelConfig, rank: int, tp: int) -> Slice | None:
    """The part of parameter `name` that rank `rank` of `tp` holds; None = the whole tensor."""
    if tp == 1:
        return None
    q_per_rank = cfg.num_attention_heads // tp * cfg.head_dim
    kv_per_rank = cfg.num_key_value_heads // tp * cfg.head_dim
    inter_per_rank = cfg.intermediate_size // tp
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return 0, rank * q_per_rank, (rank + 1) * q_per_rank
    if name.endswith(
        (
            "self_attn.k_proj.weight",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.weight",
            "self_attn.v_proj.bias",
        )
    ):
        return 0, rank * kv_per_rank, (rank + 1) * kv_per_rank
    if name.endswith("self_attn.o_proj.weight"):
        return 1, rank * q_per_rank, (rank + 1) * q_per_rank
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return 0, rank * inter_per_rank, (rank + 1) * inter_per_rank
    if name.endswith("mlp.down_proj.weight"):
        return 1, rank * inter_per_rank, (rank + 1) * inter_per_rank
    return None
