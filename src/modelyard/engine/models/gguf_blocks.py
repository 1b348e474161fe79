"""Quantization `gguf`: a model loaded (dequantized) from a GGUF file gets the file's own
Q4_0 / Q4_1 / Q8_0 blocks back for its matmuls, embedding and LM head (`engine.gguf_linear`).

A fused projection (q|k|v, gate|up) keeps its blocks where all its parts are of one kept type:
blocks are whole rows, so the parts' rows are concatenated as the float weights are (and Q/K
rows un-permuted as the converter does). Any other matrix (Q4_K, Q6_K, float, mixed parts)
stays the float layer it was loaded as. Under `gguf+w8a8` the model arrives w8a8-quantized:
each layer swapped keeps its w8a8 form as the blocks' `wide` copy, and any other stays w8a8.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from modelyard.engine.gguf_linear import BLOCK, BLOCK_BYTES, GGUFEmbedding, GGUFLinear
from modelyard.engine.models.gguf_convert import PERMUTED_QK_ARCHS, field, unpermute
from modelyard.engine.models.llama import LlamaForCausalLM
from modelyard.engine.quantization import Int8Linear

log = logging.getLogger(__name__)


class _File:
    """The GGUF file's tensors by name, read as `[rows, row bytes]` block rows."""

    def __init__(self, path: Path) -> None:
        import gguf

        reader = gguf.GGUFReader(str(path))
        self.arch = field(reader, "general.architecture")
        self.tensors: dict[str, Any] = {t.name: t for t in reader.tensors}

    def rows(self, name: str, heads: int | None = None) -> tuple[np.ndarray, int, int] | None:
        """(block rows, GGML type, in_features) of a kept tensor, else None."""
        t = self.tensors.get(name)
        if t is None or int(t.tensor_type) not in BLOCK_BYTES or int(t.shape[0]) % BLOCK:
            return None
        data = np.asarray(t.data)
        if heads is not None and self.arch in PERMUTED_QK_ARCHS:
            data = unpermute(data, heads)  # rows only: blocks never straddle a row
        return data, int(t.tensor_type), int(t.shape[0])

    def linear(
        self, parts: list[tuple[str, int | None]], bias: torch.Tensor | None
    ) -> GGUFLinear | None:
        """One layer over the parts' rows, concatenated; None unless all are one kept type."""
        found = [self.rows(name, heads) for name, heads in parts]
        kept = [f for f in found if f is not None]
        if len(kept) != len(found) or len({(t, k) for _, t, k in kept}) != 1:
            return None
        blocks = np.concatenate([data for data, _, _ in kept])  # a copy: the file is let go
        _, ggml_type, in_features = kept[0]
        return GGUFLinear(torch.from_numpy(blocks), ggml_type, in_features, bias)


def keep_gguf_blocks(model: LlamaForCausalLM, gguf_path: Path, dtype: torch.dtype) -> int:
    """Swap the fused, loaded model's matmuls (and embedding and LM head) for the GGUF file's
    blocks where kept (see the module docstring); returns how many were swapped."""
    file = _File(gguf_path)
    cfg = model.config
    swapped, left = 0, 0

    def swap(owner: nn.Module, attr: str, parts: list[tuple[str, int | None]]) -> None:
        nonlocal swapped, left
        current = getattr(owner, attr)
        layer = file.linear(parts, getattr(current, "bias", None))
        if layer is None:
            left += 1
            return
        assert layer.out_features == current.out_features, f"{parts[0][0]}: shape"
        if isinstance(current, Int8Linear):  # gguf+w8a8: its rows serve the wide matmuls
            layer.wide = current
        setattr(owner, attr, layer)
        swapped += 1

    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    for i, layer in enumerate(model.model.decoder_layers()):
        attn, mlp = layer.self_attn, layer.mlp
        p = f"blk.{i}."
        swap(attn, "qkv_proj", [(p + "attn_q.weight", heads), (p + "attn_k.weight", kv_heads),
                                (p + "attn_v.weight", None)])  # fmt: skip
        swap(attn, "o_proj", [(p + "attn_output.weight", None)])
        swap(mlp, "gate_up_proj", [(p + "ffn_gate.weight", None), (p + "ffn_up.weight", None)])
        swap(mlp, "down_proj", [(p + "ffn_down.weight", None)])
    embedding = file.rows("token_embd.weight")
    if embedding is not None:
        data, ggml_type, dim = embedding
        model.model.embed_tokens = GGUFEmbedding(
            torch.from_numpy(data.copy()), ggml_type, dim, dtype
        )
        swapped += 1
    head = model.lm_head
    if not cfg.tie_word_embeddings:
        if head is not None:
            swap(model, "lm_head", [("output.weight", None)])
    elif isinstance(model.model.embed_tokens, GGUFEmbedding):
        model.lm_head = model.model.embed_tokens.as_linear()
        if isinstance(head, Int8Linear):  # w8a8's own head, smoothed for its activations
            model.lm_head.wide = head
        swapped += 1
    log.info("GGUF blocks kept for %d matrices; %d stay float", swapped, left)
    return swapped
