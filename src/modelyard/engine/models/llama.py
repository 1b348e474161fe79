"""The Llama family (Llama 2/3, Mistral, Qwen2/3, SmolLM2) in plain PyTorch over a flat token batch,
and its mixture-of-experts relatives (Mixtral, Qwen2-MoE, OLMoE: `moe.py` in place of the MLP).

Parameter names follow Hugging Face's checkpoints so that safetensors load by name; q/k/v and
gate/up projections are fused into one matmul each at load time (`fuse_projections`).

With tensor parallelism (`tp_size > 1`) each rank builds the layers for its own share of the
attention heads and of the MLP (see `sharding.py`); the row-parallel o_proj and down_proj outputs
are summed across ranks with one all-reduce each, so every rank ends a layer with the full hidden
state.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from modelyard.engine.attention import AttentionMetadata, paged_attention, write_kv
from modelyard.engine.models.config import ModelConfig
from modelyard.engine.models.decode_step import OneCallDecode
from modelyard.engine.models.mlp import MLP, all_reduce, fused_linear
from modelyard.engine.models.moe import SparseMoeBlock
from modelyard.engine.models.packed_linear import pack_linears, pack_matrix
from modelyard.engine.step_interrupt import StepInterrupt

if TYPE_CHECKING:
    from modelyard.engine.cpu_kernels import CpuKernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels: CpuKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dtype == torch.float32 and x.dim() == 2:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 whatever the model dtype, as the reference implementation does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    # Explicitly on the CPU: the model is built on the meta device, and running these ops there
    # the first time costs a second of lazy initialization for a table we rebuild anyway.
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (cfg.rope_theta ** (steps / dim))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table precomputed for every position."""

    cos: torch.Tensor  # buffers [positions, head_dim]
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = _rope_inv_freq(cfg)
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.num_heads = cfg.num_attention_heads // tp_size
        self.num_kv_heads = cfg.num_key_value_heads // tp_size
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.q_size, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        # Qwen3 normalises each head; OLMoE the whole q and k projections (`qk_norm_whole`).
        self.qk_norm_whole = cfg.qk_norm_whole
        q_norm_size, k_norm_size = (
            (self.q_size, self.kv_size) if cfg.qk_norm_whole else (self.head_dim, self.head_dim)
        )
        self.q_norm = RMSNorm(q_norm_size, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_norm_size, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qkv_proj: nn.Linear | None = None
        self.kernels: CpuKernels | None = None

    def fuse(self) -> None:
        """Replace q/k/v projections by one matmul over their concatenated weights."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_proj = fused_linear(parts)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        if self.qkv_proj is None:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        else:
            qkv = self.qkv_proj(x)
        t = x.shape[0]
        if self.kernels is not None and self._fused_rope_applies(qkv, cache):
            # RoPE and the KV-cache write in one C call, in place in the q|k|v rows.
            qkv = qkv.contiguous()
            self.kernels.rope_write_kv(
                qkv, rope.cos, rope.sin, positions, meta.slot_mapping, cache, self.num_heads
            )
            q, k, v = self._heads(qkv, t)
        else:
            q, k, v = self._heads(qkv, t)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self._qk_norm(q, k)
            q, k = rope(positions, q, k)
            write_kv(cache, meta.slot_mapping, k, v)
        out = paged_attention(q, k, v, cache, meta, self.scale)
        out = self.o_proj(out.reshape(t, self.q_size))
        return all_reduce(out) if self.tp_size > 1 else out

    def _heads(self, qkv: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.reshape(t, self.num_heads, self.head_dim),
            k.reshape(t, self.num_kv_heads, self.head_dim),
            v.reshape(t, self.num_kv_heads, self.head_dim),
        )

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.q_norm is not None and self.k_norm is not None
        if not self.qk_norm_whole:
            return self.q_norm(q), self.k_norm(k)
        t = q.shape[0]
        q_flat = self.q_norm(q.reshape(t, self.q_size))
        k_flat = self.k_norm(k.reshape(t, self.kv_size))
        return q_flat.view(q.shape), k_flat.view(k.shape)

    def _fused_rope_applies(self, qkv: torch.Tensor, cache: torch.Tensor) -> bool:
        return (
            self.q_norm is None
            and qkv.dtype == torch.float32
            and cache.dtype in (torch.float32, torch.bfloat16)
        )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, tp_size)
        # A mixture-of-experts layer (Mixtral, Qwen2-MoE, OLMoE) or the dense MLP.
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(cfg.hidden_size, cfg.moe)
            if cfg.moe is not None and cfg.moe.is_sparse(index)
            else MLP(cfg.hidden_size, cfg.intermediate_size // tp_size, tp_size)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), rope, meta, cache)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp_size: int = 1) -> None:
        super().__init__()
        # An explicit weight skips the random init: on the meta device that init alone pulls in
        # torch's compiler stack (over a second of a cold start) for values that get replaced.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        # nn.Embedding until quantization swaps in its int8 form
        self.embed_tokens: nn.Module = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp_size, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg, max_positions)

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers, typed (an `nn.ModuleList` yields plain modules)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, max_positions: int | None = None, tp_size: int = 1
    ) -> None:
        """`tp_size > 1`: this rank's shard (heads and MLP slice); call under an initialised
        `torch.distributed` default group of `tp_size` ranks."""
        super().__init__()
        self.config = cfg
        self.tp_size = tp_size
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings, tp_size)
        self.lm_head: nn.Module | None = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.kernels: CpuKernels | None = None
        self.one_call = OneCallDecode()
        self.interrupt: StepInterrupt | None = None  # the engine's, checked between layers

    def use_kernels(self, kernels: CpuKernels | None) -> None:
        """Run norms, RoPE with the KV write and w8a8's activation scaling (and matmul, with
        VNNI) through `kernels` (float32 on CPU; each module keeps PyTorch's ops where its
        inputs do not fit), and decode steps in one call where all of it is C, or not."""
        for module in self.modules():
            if hasattr(module, "kernels"):
                setattr(module, "kernels", kernels)  # noqa: B010  # this model's own among them
        self.one_call.forget()

    def fuse_projections(self) -> None:
        for layer in self.model.decoder_layers():
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` of the flat batch after the final norm."""
        x: torch.Tensor = self.model.embed_tokens(input_ids)
        step = self.one_call.step_for(self, self.kernels, input_ids, meta, kv_caches)
        stop = self.interrupt
        if step is not None:
            x = x.contiguous()  # updated in place by the C step
            step.run(x, positions, meta, stop.address() if stop is not None else 0)
            return self.final_norm(x)
        rope = self.model.rotary
        for layer, cache in zip(self.model.decoder_layers(), kv_caches, strict=True):
            if stop is not None:
                stop.check()
            x = layer(positions, x, rope, meta, cache)
        return self.final_norm(x)

    def pack_for_cpu(self) -> None:
        """Swap every matmul, the LM head included, for its prepacked oneDNN form."""
        pack_linears(self.model)
        if self.lm_head is None:
            self.lm_head = pack_matrix(self.embedding_weight())
        else:
            pack_linears(self)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        normed: torch.Tensor = self.model.norm(x)
        return normed

    def embedding_weight(self) -> torch.Tensor:
        """The float token embedding (what a tied LM head multiplies by)."""
        weight = self.model.embed_tokens.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embedding_weight()).float()
        logits: torch.Tensor = self.lm_head(hidden).float()
        return logits
