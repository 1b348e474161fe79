"""Attention over the paged KV cache, in plain PyTorch (`scaled_dot_product_attention`).

The flat batch of one step holds the single-token decodes first, then the prefill chunks.
Decodes run in one call: on CPU the C kernel of `cpu_kernels` reads each sequence's blocks in
place; elsewhere one padded batched SDPA over their gathered blocks, with each KV head's group
of query heads folded into the query axis (no K/V expansion for grouped-query attention). Each
prefill chunk runs alone, straight from its fresh keys when it has no cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from modelyard.engine.cpu_kernels import CpuKernels


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens in the flat batch, attending to its whole context."""

    start: int  # first index of the chunk in the flat batch
    end: int  # one past its last index
    num_computed: int  # tokens of this sequence already in the cache before the chunk
    context_blocks: torch.Tensor | None  # block ids covering the context; None without prefix


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K and V are written
    block_size: int
    num_decodes: int  # the first `num_decodes` tokens are single-token decodes
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] block ids, padded with block 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] True inside context
    prefills: list[PrefillChunk]
    # With the C kernels: them, and each decode's context length (no mask then).
    kernels: CpuKernels | None = None
    decode_lengths: torch.Tensor | None = None  # [B] int64


def write_kv(
    cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store the new tokens' K and V (`[T, kv_heads, head_dim]`) in their cache slots (in the
    cache's dtype, which may be narrower than the model's)."""
    cache[0].index_copy_(0, slot_mapping, k.to(cache.dtype))
    cache[1].index_copy_(0, slot_mapping, v.to(cache.dtype))


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[*blocks.shape[:-1], n_blocks * block_size, kv_heads, head_dim]` copied out of the cache.

    Whole blocks are copied as contiguous rows, far cheaper than gathering token by token.
    """
    per_block = cache.view(-1, block_size * cache.shape[1] * cache.shape[2])
    rows = per_block.index_select(0, blocks.reshape(-1))
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, *cache.shape[1:])


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim], this step's keys (already in the cache)
    v: torch.Tensor,
    cache: torch.Tensor,  # [2, num_slots, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    gqa = heads != kv_heads
    nd = meta.num_decodes
    if nd and meta.kernels is not None:
        assert meta.decode_block_tables is not None and meta.decode_lengths is not None
        o = meta.kernels.decode_attention(
            q[:nd].float(),
            cache,
            meta.decode_block_tables,
            meta.decode_lengths,
            meta.block_size,
            scale,
        )
        out[:nd] = o.to(q.dtype)
    elif nd:
        assert meta.decode_block_tables is not None
        kc = gather_blocks(cache[0], meta.decode_block_tables, meta.block_size)
        vc = gather_blocks(cache[1], meta.decode_block_tables, meta.block_size)
        kc, vc = kc.transpose(1, 2).to(q.dtype), vc.transpose(1, 2).to(q.dtype)
        # [B, kv_heads, group, D]: one KV head's query heads act as its "query positions".
        qd = q[:nd].view(nd, kv_heads, heads // kv_heads, dim)
        o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = o.reshape(nd, heads, dim)
    for chunk in meta.prefills:
        qc = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, D]
        if chunk.context_blocks is None:
            kc = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            vc = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            kc = gather_blocks(cache[0], chunk.context_blocks, meta.block_size)
            vc = gather_blocks(cache[1], chunk.context_blocks, meta.block_size)
            kc = kc.transpose(0, 1).unsqueeze(0).to(q.dtype)
            vc = vc.transpose(0, 1).unsqueeze(0).to(q.dtype)
            n = chunk.end - chunk.start
            # Query i sits at position num_computed + i and sees every key up to there; the
            # padding after the context lies beyond every query's position.
            mask = torch.ones(n, kc.shape[2], dtype=torch.bool, device=q.device).tril(
                diagonal=chunk.num_computed
            )
            o = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        out[chunk.start : chunk.end] = o.squeeze(0).transpose(0, 1)
    return out
