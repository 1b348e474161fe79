"""Linear layers and the token embedding over a GGUF file's own quantized blocks (quantization
`gguf`): Q4_0, Q4_1 and Q8_0 weights stay in the file's bytes (0.56, 0.63 and 1.06 bytes a
weight), and the matmul reads them in place (`csrc/gguf_matmul.c`: integer dot products
against activations quantized to int8 in blocks of 32). Without the C kernels the blocks are
dequantized on each call (correct, slow: a fallback, not a mode).

Quantization `gguf+w8a8` gives each such layer a second copy of its weights, w8a8's FBGEMM
int8 rows (`wide`), for the matmuls of more than `BLOCK_ROWS_MAX` rows: per row the blocks cost
a float scale per 32 weights where int8 rows cost none, so FBGEMM wins on wide matmuls (AVX2,
BENCHMARKS.md: all of SmolLM2's matmuls at 8 / 32 / 256 rows 31 / 116 / 850 ms on the blocks,
15 / 34 / 216 ms under FBGEMM), while up to four rows (one pass over the weights) the blocks'
one-call decode step wins (SmolLM2 decode tokens/s at 2 / 3 / 4 sequences: 113 / 141 / 150 on
the blocks, 80 / 115 / 135 on w8a8). Both copies stay in memory.

A block of 32 weights is a float16 scale d, for Q4_1 a float16 minimum m, then the quants:
Q8_0 32 int8 q (w = d q); Q4_0 16 bytes of nibbles n (w = d (n - 8)); Q4_1 likewise
(w = d n + m). A Q4 byte j holds element j in its low nibble and element j + 16 in its high.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from modelyard.engine.cpu_kernels import CpuKernels
    from modelyard.engine.quantization import Int8Linear

# The quantizations that keep a GGUF file's blocks.
GGUF_QUANTIZATIONS = ("gguf", "gguf+w8a8")
# GGML's type numbers of the formats kept as blocks, and the bytes of one block of 32.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
BLOCK = 32
# With a `wide` copy: matmuls of up to this many rows read the blocks, wider ones the copy (the
# C matmul's rows a weight pass serves, TILE in csrc/gguf_matmul.c).
BLOCK_ROWS_MAX = 4


def dequantize_blocks(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Float32 `[rows, 32 * blocks a row]` of `blocks` (`[rows, row bytes]` uint8)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, BLOCK_BYTES[ggml_type])
    d = b[..., :2].contiguous().view(torch.float16).float()  # [rows, nb, 1]
    if ggml_type == Q8_0:
        w = d * b[..., 2:].contiguous().view(torch.int8).float()
    else:
        qs = b[..., 4:] if ggml_type == Q4_1 else b[..., 2:]
        n = torch.cat((qs & 15, qs >> 4), dim=-1).float()
        if ggml_type == Q4_0:
            w = d * (n - 8.0)
        else:
            w = d * n + b[..., 2:4].contiguous().view(torch.float16).float()
    return w.reshape(rows, -1)


class GGUFLinear(nn.Module):
    """`y = x @ W^T + bias` with W as GGUF blocks (`blocks`: `[out, in / 32 * block bytes]`
    uint8); float32 activations. `wide`, set by quantization `gguf+w8a8`: the same matrix as
    w8a8 int8 rows, which run the matmuls of more than `BLOCK_ROWS_MAX` rows (and all of them
    where no C kernels run)."""

    blocks: torch.Tensor  # buffer
    wide: Int8Linear | None

    def __init__(
        self, blocks: torch.Tensor, ggml_type: int, in_features: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        if ggml_type not in BLOCK_BYTES or in_features % BLOCK:
            raise ValueError(f"GGML type {ggml_type} with {in_features} inputs is not kept")
        assert blocks.shape[1] == in_features // BLOCK * BLOCK_BYTES[ggml_type]
        self.ggml_type = ggml_type
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kernels: CpuKernels | None = None  # the model's `use_kernels`
        self.wide = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.wide is not None and (x2.shape[0] > BLOCK_ROWS_MAX or self.kernels is None):
            out: torch.Tensor = self.wide(x)
            return out
        if self.kernels is not None and x2.dtype == torch.float32:
            bias = None if self.bias is None else self.bias.float()
            y = self.kernels.gguf_matmul(x2.contiguous(), self.blocks, self.ggml_type, bias)
        else:
            weight = dequantize_blocks(self.blocks, self.ggml_type).to(x2.dtype)
            y = F.linear(x2, weight, self.bias)
        return y.reshape(*shape[:-1], self.out_features)


class GGUFEmbedding(nn.Module):
    """Token embedding rows as GGUF blocks, dequantized on lookup."""

    blocks: torch.Tensor  # buffer

    def __init__(self, blocks: torch.Tensor, ggml_type: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        assert blocks.shape[1] == dim // BLOCK * BLOCK_BYTES[ggml_type]
        self.ggml_type = ggml_type
        self.dim = dim
        self.dtype = dtype
        self.register_buffer("blocks", blocks.contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_blocks(self.blocks[ids.reshape(-1)], self.ggml_type)
        return rows.to(self.dtype).reshape(*ids.shape, self.dim)

    def as_linear(self) -> GGUFLinear:
        """The tied LM head over the same blocks (no second copy)."""
        return GGUFLinear(self.blocks, self.ggml_type, self.dim, None)
