"""Attention over the paged KV cache, in plain PyTorch (`scaled_dot_product_attention`).

The flat batch of one step holds the single-token decodes first, then the prefill chunks.
Decodes run as one padded batched call that gathers each sequence's keys through its slot table;
each prefill chunk runs alone, straight from its fresh keys when it has no cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens in the flat batch, attending to its whole context."""

    start: int  # first index of the chunk in the flat batch
    end: int  # one past its last index
    num_computed: int  # tokens of this sequence already in the cache before the chunk
    context_slots: torch.Tensor | None  # [num_computed + chunk] cache slots; None without prefix


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K and V are written
    num_decodes: int  # the first `num_decodes` tokens are single-token decodes
    decode_slots: torch.Tensor | None  # [B, L] cache slots of each decode's context, padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] True where the key is part of the context
    prefills: list[PrefillChunk]


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Store the new tokens' K and V (`[T, kv_heads, head_dim]`) in their cache slots."""
    cache[0].index_copy_(0, slot_mapping, k)
    cache[1].index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim], this step's keys (already in the cache)
    v: torch.Tensor,
    cache: torch.Tensor,  # [2, num_slots, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    nd = meta.num_decodes
    if nd:
        assert meta.decode_slots is not None
        kc = cache[0][meta.decode_slots].transpose(1, 2)  # [B, kv_heads, L, D]
        vc = cache[1][meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2),  # [B, heads, 1, D]
            kc,
            vc,
            attn_mask=meta.decode_mask,
            scale=scale,
            enable_gqa=gqa,
        )
        out[:nd] = o.squeeze(2)
    for chunk in meta.prefills:
        qc = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, D]
        if chunk.context_slots is None:
            kc = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            vc = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            kc = cache[0][chunk.context_slots].transpose(0, 1).unsqueeze(0)
            vc = cache[1][chunk.context_slots].transpose(0, 1).unsqueeze(0)
            n = chunk.end - chunk.start
            # Query i sits at position num_computed + i and sees every key up to there.
            mask = torch.ones(n, kc.shape[2], dtype=torch.bool, device=q.device).tril(
                diagonal=chunk.num_computed
            )
            o = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        out[chunk.start : chunk.end] = o.squeeze(0).transpose(0, 1)
    return out
