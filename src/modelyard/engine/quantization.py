"""Int8 quantization of the linear layers and the embedding: per-output-channel int8 weights.

Every linear layer keeps an int8 `[out, in]` matrix and one scale per output row. Two modes:

- `int8` (weight-only): activations stay in the model dtype. The matmul is
  `aten._weight_int8pack_mm` (`int8pack`) on CPU, else the weight is dequantized on the fly
  (`dequant`). About 1 byte per parameter (25 % of float32 for SmolLM2). PyTorch vectorises
  `int8pack` for AVX-512 CPUs, not for AVX2, where it measured 3x slower than float32
  (SmolLM2 decode at batch 1, AMD EPYC AVX2): there `w8a8` is the fast one.
- `w8a8`: FBGEMM's dynamic int8 linear (`quantized::linear_dynamic`, x86 CPUs, float32
  activations): the activations are quantized to int8 too, per token (each row is scaled to the
  same range first, so one token's outliers do not coarsen another's) after SmoothQuant
  factors, set by one calibration prefill at load, have moved the activations' outlier channels
  into the weights; products accumulate in int32. 1.7-3.5x float32's tokens/s on AVX2, less
  accurate than `int8` (BENCHMARKS.md), and FBGEMM's packed weights take ~1.8 bytes
  each. On CPUs with AVX-512 VNNI the C kernels (`cpu_kernels.py`, `csrc/int8_matmul.c`) run
  the matmul instead, from plain int8 rows (1 byte each), quantizing each token's activations
  to 8 symmetric bits (FBGEMM: 7 asymmetric ones); on CPUs with AMX a second copy of the rows
  in the tiles' order (one more byte a weight) runs batches of 8+ rows on the tiles.

The token embedding is quantized per row too; with tied embeddings the `int8` LM head reuses
its rows, the `w8a8` one is its own packed copy.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from modelyard.engine.cpu_kernels import CpuKernels

QUANTIZATIONS = ("int8", "w8a8")


def int8_kernel(mode: str, device_type: str, dtype: torch.dtype) -> str:
    """The matmul kernel of quantization `mode` here: `int8pack`/`dequant` for `int8`,
    `fbgemm` for `w8a8` (`ValueError` naming what it needs where FBGEMM cannot run it)."""
    if mode == "w8a8":
        if device_type != "cpu" or dtype != torch.float32 or not fbgemm_available():
            raise ValueError(
                "quantization 'w8a8' runs on x86 CPUs with float32 activations (FBGEMM); "
                f"this engine is on {device_type} with {dtype}: use 'int8'"
            )
        return "fbgemm"
    return "int8pack" if int8_kernel_available(device_type) else "dequant"


@functools.cache
def fbgemm_available() -> bool:
    """Whether FBGEMM's dynamic int8 linear runs here (x86 CPU builds of torch)."""
    try:
        layer = _fbgemm_pack(torch.zeros(8, 32, dtype=torch.int8), torch.ones(8))
        torch.ops.quantized.linear_dynamic(torch.zeros(1, 32), layer, True)
    except (RuntimeError, AttributeError):
        return False
    return True


def _fbgemm_pack(q: torch.Tensor, scale: torch.Tensor) -> torch.ScriptObject:
    """FBGEMM's packed form of int8 rows `q` with per-row `scale` (no bias: added outside)."""
    zeros = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated, not yet removed
        warnings.simplefilter("ignore", UserWarning)
        qt = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
    packed: torch.ScriptObject = torch.ops.quantized.linear_prepack(qt, None)
    return packed


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
    """`y = x @ (q * scale)^T + bias` with int8 `q` and the scale in the activation dtype.

    Under the `fbgemm` kernel (w8a8) the int8 rows are in one of two forms, never both: FBGEMM's
    packed copy (`packed`, whose size `packed_bytes` is what `weight_bytes` counts for it), or,
    while C kernels with a vectorised int8 matmul are in use (`kernels`), plain rows
    (`qweight`, one byte each) with their sums."""

    # Buffers, typed here (nn.Module's __getattr__ would make each `Tensor | Module`).
    qweight: torch.Tensor | None  # None only while FBGEMM's packed copy holds the rows
    scale: torch.Tensor
    inv_smooth: torch.Tensor | None
    weight_sums: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        kernel: str = "dequant",
        smooth: torch.Tensor | None = None,
    ) -> None:
        """`smooth` (fbgemm only): per-input-channel factors already multiplied into the weight
        before quantizing; activations are divided by them (SmoothQuant)."""
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.kernel = kernel
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.packed: torch.ScriptObject | None = None
        self.packed_bytes = 0
        self.amx_weight: torch.Tensor | None = None  # the rows in AMX tile order (`_unpack`)
        self._kernels: CpuKernels | None = None
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(dtype))
        if self.kernel == "fbgemm":
            inverse = None if smooth is None else (1.0 / smooth).to(dtype)
            self.register_buffer("inv_smooth", inverse)
            self.register_buffer("weight_sums", None, persistent=False)
            self._pack()

    @property
    def kernels(self) -> CpuKernels | None:
        """The C kernels w8a8 runs its activation scaling (and, with VNNI, its matmul) with."""
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: CpuKernels | None) -> None:
        self._kernels = kernels
        if self.kernel == "fbgemm":
            if kernels is not None and kernels.int8_matmul_vectorized:
                self._unpack()
            else:
                self._pack()

    def _pack(self) -> None:
        if self.packed is None:
            assert self.qweight is not None  # the rows are in one form or the other
            self.packed = _fbgemm_pack(self.qweight, self.scale)
            # Measured: FBGEMM's packed weights hold ~1.8 bytes of RSS per int8 weight (why was
            # not investigated); counted as 2.
            self.packed_bytes = 2 * self.qweight.numel() + 8 * self.out_features
            self.qweight = self.weight_sums = self.amx_weight = None

    def _unpack(self) -> None:
        if self.packed is not None:
            qweight = torch.ops.quantized.linear_unpack(self.packed)[0].int_repr().contiguous()
            self.qweight = qweight
            self.weight_sums = qweight.sum(dim=1, dtype=torch.int32)
            self.packed, self.packed_bytes = None, 0
        # On AMX CPUs a second copy in the tiles' order runs batches of rows (decode steps of
        # 16+ sequences, prefill) ~8x faster than VNNI (BENCHMARKS.md): one more byte a weight.
        assert self._kernels is not None and self.qweight is not None
        self.amx_weight = self._kernels.amx_pack(self.qweight)
        self.packed_bytes = 0 if self.amx_weight is None else self.amx_weight.numel()

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        kernel: str = "dequant",
        activation_max: torch.Tensor | None = None,
    ) -> Int8Linear:
        """`activation_max`: each input channel's largest |activation| seen in calibration;
        with the `fbgemm` kernel it sets SmoothQuant factors that move the activations'
        outlier channels into the weight, where per-row weight scales absorb them."""
        smooth = None
        if kernel == "fbgemm" and activation_max is not None:
            weight_max = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
            smooth = (activation_max.float().clamp(min=1e-5).sqrt() / weight_max.sqrt()).clamp(
                min=1e-2, max=1e2
            )
            weight = weight.detach().float() * smooth
        q, scale = quantize_rows(weight)
        return cls(q, scale, bias, dtype, kernel, smooth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kernel == "fbgemm" and self.packed is None:  # w8a8 in C (VNNI)
            assert self._kernels is not None
            assert self.qweight is not None and self.weight_sums is not None  # unpacked
            y = self._kernels.int8_matmul(
                x2.contiguous(), self.qweight, self.weight_sums, self.scale, self.bias,
                self.inv_smooth, self.amx_weight,
            )  # fmt: skip
            return y.reshape(*shape[:-1], self.out_features)
        if self.packed is not None:  # w8a8: float32 activations (checked at load)
            if x2.shape[0] > 1 and self.kernels is not None:
                x2, row_max = self.kernels.smooth_rows(x2, self.inv_smooth)
                y = torch.ops.quantized.linear_dynamic(x2, self.packed, True) * row_max
                return self._finish(y, shape)
            if self.inv_smooth is not None:
                x2 = x2 * self.inv_smooth
            if x2.shape[0] == 1:  # one token (a lone decode): per-tensor is per-token
                y = torch.ops.quantized.linear_dynamic(x2, self.packed, True)
            else:
                # Per-token activation scales through a per-tensor kernel: every row is
                # brought to the same range first (absmax 1), so the kernel's one scale fits
                # each row.
                row_max = x2.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
                y = torch.ops.quantized.linear_dynamic(x2 / row_max, self.packed, True)
                y = y * row_max
        elif self.kernel == "int8pack" and x2.dtype == self.scale.dtype:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scale)
        else:  # dequantize on the fly (CUDA, or a dtype the kernel does not take)
            assert self.qweight is not None  # only w8a8 ever packs its rows
            y = F.linear(x2, self.qweight.to(x2.dtype)) * self.scale.to(x2.dtype)
        return self._finish(y, shape)

    def _finish(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """Token embedding rows kept int8 with a scale per row (dequantized on lookup)."""

    qweight: torch.Tensor  # buffers
    scale: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(dtype))
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(self.dtype) * self.scale[ids].unsqueeze(-1)

    def as_linear(self) -> Int8Linear:
        """The tied LM head over the same int8 rows (no second copy)."""
        kernel = int8_kernel("int8", self.qweight.device.type, self.dtype)
        return Int8Linear(self.qweight, self.scale.float(), None, self.dtype, kernel)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and persistent buffer (not the RoPE tables), each storage
    counted once (a tied head shares the embedding's), plus FBGEMM's packed int8 copies (the
    only copy of those weights); oneDNN's packed float copies are not counted."""
    seen: set[int] = set()
    total = sum(getattr(m, "packed_bytes", 0) for m in model.modules())
    for t in model.state_dict(keep_vars=True).values():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total
