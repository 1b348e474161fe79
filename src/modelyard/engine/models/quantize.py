"""Quantizing a loaded model in place: every linear layer, the token embedding and the LM head
swapped for their int8 forms (`quantization.py` holds the layers and the modes), `w8a8` after
one calibration prefill that measures each layer's input ranges for SmoothQuant."""

from __future__ import annotations

import torch
from torch import nn

from modelyard.engine.attention import AttentionMetadata, PrefillChunk
from modelyard.engine.models.llama import LlamaForCausalLM
from modelyard.engine.quantization import Int8Embedding, Int8Linear, int8_kernel, quantize_rows


def _quantize_children(
    module: nn.Module, dtype: torch.dtype, kernel: str, ranges: dict[nn.Module, torch.Tensor]
) -> int:
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            layer = Int8Linear.from_weight(
                child.weight, child.bias, dtype, kernel, activation_max=ranges.get(child)
            )
            setattr(module, name, layer)
            count += 1
        else:
            count += _quantize_children(child, dtype, kernel, ranges)
    return count


CALIBRATION_TOKENS = 256


@torch.inference_mode()
def activation_ranges(model: LlamaForCausalLM) -> dict[nn.Module, torch.Tensor]:
    """Each linear layer's (and the LM head's, keyed by the model) largest |input| per channel
    over one prefill of `CALIBRATION_TOKENS` seeded random token ids.

    Random ids, not text: the outlier channels SmoothQuant moves are a property of the weights
    (the same channels whatever the text), and any model can be calibrated without a dataset.
    """
    cfg = model.config
    # within the positions this load's RoPE table holds (the engine's max_model_len)
    n = min(CALIBRATION_TOKENS, cfg.max_position_embeddings, model.model.rotary.cos.shape[0])
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    ranges: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0).float()
        ranges[module] = torch.maximum(ranges[module], seen) if module in ranges else seen

    hooks = [
        m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, nn.Linear)
    ]
    kv_heads = cfg.num_key_value_heads // model.tp_size
    caches = [torch.zeros(2, n, kv_heads, cfg.head_dim) for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_size=n,
        num_decodes=0,
        decode_block_tables=None,
        decode_mask=None,
        prefills=[PrefillChunk(0, n, 0, None)],
    )
    try:
        hidden = model(ids, torch.arange(n), meta, caches)
    finally:
        for hook in hooks:
            hook.remove()
    ranges[model] = hidden.abs().amax(dim=0).float()
    return ranges


def quantize_model(model: LlamaForCausalLM, dtype: torch.dtype, mode: str) -> int:
    """Swap a loaded (fused, unpacked) `LlamaForCausalLM`'s linears, embedding and LM head for
    their int8 forms in place (`mode`: `int8` or `w8a8`, see the module docstring); returns
    how many matmuls were quantized. `w8a8` first runs its calibration prefill."""
    inner = model.model
    assert isinstance(inner.embed_tokens, nn.Embedding), "quantized twice"
    weight = inner.embed_tokens.weight
    kernel = int8_kernel(mode, weight.device.type, dtype)
    fbgemm = kernel == "fbgemm"
    ranges = activation_ranges(model) if fbgemm else {}
    count = _quantize_children(inner, dtype, kernel, ranges)
    q, scale = quantize_rows(weight)
    embedding = Int8Embedding(q, scale, dtype)
    inner.embed_tokens = embedding
    head = model.lm_head
    if head is None and not fbgemm:
        model.lm_head = embedding.as_linear()
    else:  # its own weight, or the tied one smoothed for the head's own activations
        if head is None:
            head_weight, bias = weight, None
        else:
            assert isinstance(head, nn.Linear)  # not yet quantized or packed
            head_weight, bias = head.weight, head.bias
        model.lm_head = Int8Linear.from_weight(
            head_weight, bias, dtype, kernel, activation_max=ranges.get(model)
        )
    return count + 1
