"""Weight-only int8 quantization (`quantization: "int8"`): per-output-channel int8 weights.

Every linear layer keeps an int8 `[out, in]` matrix and one scale per output row; activations
stay in the model dtype. On CPU the matmul is `aten._weight_int8pack_mm` (int8 weights are
converted inside the kernel's tiles, never materialised whole); elsewhere, or where that op is
missing, the weight is dequantized on the fly. The token embedding is quantized the same way
(per row), and with tied embeddings the LM head reuses it, so the whole model is ~1 byte per
parameter (about 26 % of float32).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("int8",)


@functools.cache
def int8_kernel_available(device_type: str) -> bool:
    """Whether `_weight_int8pack_mm` runs here (CPU builds of torch >= 2.4 have it)."""
    if device_type != "cpu" or not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    try:
        torch.ops.aten._weight_int8pack_mm(
            torch.zeros(1, 32), torch.zeros(8, 32, dtype=torch.int8), torch.ones(8)
        )
    except RuntimeError:
        return False
    return True


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: `weight ~= q * scale[:, None]`, q in [-127, 127]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class Int8Linear(nn.Module):
    """`y = x @ (q * scale)^T + bias` with int8 `q` and the scale in the activation dtype."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.fast = int8_kernel_available(qweight.device.type)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> Int8Linear:
        q, scale = quantize_rows(weight)
        return cls(q, scale, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.fast and x2.dtype == self.scale.dtype:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scale)
        else:  # dequantize on the fly (CUDA, or a dtype the kernel does not take)
            y = F.linear(x2, self.qweight.to(x2.dtype)) * self.scale.to(x2.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """Token embedding rows kept int8 with a scale per row (dequantized on lookup)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(dtype))
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(self.dtype) * self.scale[ids].unsqueeze(-1)

    def as_linear(self) -> Int8Linear:
        """The tied LM head over the same int8 rows (no second copy)."""
        return Int8Linear(self.qweight, self.scale, None, self.dtype)


def _quantize_children(module: nn.Module, dtype: torch.dtype) -> int:
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear.from_weight(child.weight, child.bias, dtype))
            count += 1
        else:
            count += _quantize_children(child, dtype)
    return count


def quantize_model_int8(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap a loaded (fused, unpacked) `LlamaForCausalLM`'s linears, embedding and LM head for
    their int8 forms in place; returns how many matmuls were quantized."""
    inner = model.model  # type: ignore[attr-defined]
    count = _quantize_children(inner, dtype)
    q, scale = quantize_rows(inner.embed_tokens.weight)
    embedding = Int8Embedding(q, scale, dtype)
    inner.embed_tokens = embedding
    if model.lm_head is None:  # type: ignore[attr-defined]
        model.lm_head = embedding.as_linear()  # type: ignore[attr-defined]
    else:
        head = model.lm_head  # type: ignore[attr-defined]
        model.lm_head = Int8Linear.from_weight(head.weight, head.bias, dtype)  # type: ignore[attr-defined]
    return count + 1


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and persistent buffer (not the RoPE tables), each storage
    counted once (a tied head shares the embedding's); oneDNN-packed copies are not counted."""
    seen: set[int] = set()
    total = 0
    for t in model.state_dict(keep_vars=True).values():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total
