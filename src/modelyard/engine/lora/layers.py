"""Batched per-row LoRA on a model's linear projections (no weight merging).

Each wrapped projection keeps stacked weights for every slot: A `[slots, P*R, in]` (P =
projections fused into this matmul, e.g. 3 for qkv, R = max rank; part p's A in rows
p*R..p*R+R, as `nn.Linear` keeps a weight) and one B per part, `[slots, R, out_p]` (no
block-diagonal padding: a part's update reads only its own B; int8 B in quads of ranks,
`[slots, R/4, out_p, 4]`, as VNNI's byte products take them). Slot 0 is the base model and
is never computed. A step sets `LoRABatch` once: which flat-batch rows use which slot. Then
every wrapped projection adds `x[rows] @ A[slot] @ B[slot]` for its adapter rows:

- with modelyard's C kernels (CPU, float32/bfloat16): one `lora_add` call (`csrc/lora.c`) for
  every row and part, streaming each adapter's A and B once per group of up to 4 of its rows,
  only the adapter's own rank of them (a slot's A and Bs lie in one block, `slot_weights`, read
  front to back);
- otherwise PyTorch: one gathered `bmm` (many adapters, one row each: decoding) or one matmul
  pair per adapter (segmented: long prefill chunks of few adapters).

With 50 adapters on every projection of SmolLM2 in one batch, PyTorch's forms (gathered, or
`torch._grouped_mm` over rows sorted by slot, which this module used to take on CPUs) cost 2 to
4 times the base model's own step; the C kernel, about a third of it (BENCHMARKS.md).

A decode step with many adapters is bound by reading their weights, so on CPUs a float32
model keeps them in float16 (`weight_dtype`: half the bytes; products and sums stay float32, and
an adapter beyond float16's range is refused when read); a bfloat16 model keeps bfloat16. Where
the base model's matmuls are quantized and the C kernel multiplies int8 (AVX-512 VNNI,
`slot_dtype`), they are kept in int8, half float16's bytes: each weight row (A's rows along `in`,
B's rows `[R, out_p]` along `out_p`) symmetric with one float32 scale (absmax / 127,
`slot_scales`), and the kernel quantizes x and h per row as it multiplies; PyTorch's forms
dequantize them as they gather.

A step without adapter rows costs one attribute check per projection.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from modelyard.engine.cpu_kernels import CpuKernels
from modelyard.engine.lora.groups import LoRAGroups


@dataclass
class LoRABatch:
    """The current step's rows per slot; shared by every wrapped projection. On a CPU the C
    kernel reads `groups` alone; PyTorch's forms' row tensors are made the first time a
    projection asks for them in a step (`torch_rows`), so a step on the C kernel builds none."""

    active: bool = False
    groups: LoRAGroups | None = None  # the rows for the C kernel (CPU)
    rows: torch.Tensor | None = None  # flat-batch rows using an adapter
    row_slots: torch.Tensor | None = None  # their slot indices (gathered mode)
    segments: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (slot, rows)
    gathered: bool = False
    all_rows: bool = False  # every row uses an adapter: no row selection, add in place
    _by_slot: dict[int, list[int]] = field(default_factory=dict)
    _device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def set(self, token_slots: list[int], device: torch.device) -> None:
        self.rows = self.row_slots = self.groups = None
        self.segments = []
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(token_slots):
            if s:
                by_slot.setdefault(s, []).append(i)
        self._by_slot, self._device = by_slot, device
        self.active = bool(by_slot)
        if not by_slot:
            return
        n_rows = sum(len(r) for r in by_slot.values())
        self.groups = LoRAGroups.of(by_slot) if device.type == "cpu" else None
        self.all_rows = n_rows == len(token_slots)
        # Few adapters with many rows each: a matmul pair per adapter beats gathering A and B
        # per row; one row each (decode with many adapters): one bmm over gathered weights.
        self.gathered = n_rows < 4 * len(by_slot)

    def torch_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows` and `row_slots` (and `segments`), made once per step."""
        if self.rows is None or self.row_slots is None:
            device, by_slot = self._device, self._by_slot
            pairs = sorted((i, s) for s, rows in by_slot.items() for i in rows)
            self.rows = torch.tensor([i for i, _ in pairs], dtype=torch.long, device=device)
            self.row_slots = torch.tensor([s for _, s in pairs], dtype=torch.long, device=device)
            self.segments = [
                (s, torch.tensor(r, dtype=torch.long, device=device)) for s, r in by_slot.items()
            ]
        return self.rows, self.row_slots

    def clear(self) -> None:
        self.set([], torch.device("cpu"))


def weight_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """How the slots keep adapter weights for a model of `dtype`: float16 for a float32 model
    on a CPU (the C kernel widens it as it reads), else the model's own."""
    return torch.float16 if dtype == torch.float32 and device.type == "cpu" else dtype


SLOT_DTYPES = {
    "int8": torch.int8,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def slot_dtype(
    setting: str, dtype: torch.dtype, device: torch.device, quantized: bool, int8_dot: bool
) -> torch.dtype:
    """The engine setting `lora_weight_dtype`: as named, or `auto`: int8 where the base model's
    matmuls are `quantized` and the C kernels multiply int8 adapters in int8 (`int8_dot`: a
    CPU with AVX-512 VNNI), else `weight_dtype`."""
    if setting != "auto":
        return SLOT_DTYPES[setting]
    if quantized and int8_dot and device.type == "cpu":
        return torch.int8
    return weight_dtype(dtype, device)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [rows, n] as int8 rows and their float32 scales: symmetric, absmax / 127 (a zero row:
    zeros, scale 0); `q * scale[:, None]` is the dequantized `w`."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    q = (w / torch.where(scale > 0, scale, 1.0)[:, None]).round().clamp(-127, 127)
    return q.to(torch.int8), scale


class LoRALinear(nn.Module):
    """`base(x)` plus each adapter row's low-rank update; `parts` = output sizes of the
    projections fused into `base` (q, k, v or gate, up), in order."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        parts: list[int],
        slots: int,
        max_rank: int,
        batch: LoRABatch,
        dtype: torch.dtype,
        device: torch.device,
        stored: torch.dtype | None = None,  # the weights' dtype: `weight_dtype` unless given
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.max_rank = max_rank
        self.batch = batch
        width = len(parts) * max_rank
        self.dtype = dtype  # the update's arithmetic (PyTorch's forms)
        stored = stored or weight_dtype(dtype, device)
        # One block per slot, A then each part's B, so that a slot's weights are one stream.
        # int8: B in quads of ranks, [R4 / 4, out_p, 4] (R4: R rounded up to 4; `csrc/lora_int8.h`)
        int8 = stored == torch.int8
        rows = -(-max_rank // 4) * 4 if int8 else max_rank
        block = width * in_features + rows * sum(parts)
        self.slot_weights = torch.zeros(slots + 1, block, dtype=stored, device=device)
        # int8: each row's scale, A's rows (`width`) then each part's B rows (`max_rank` each)
        self.slot_scales = torch.zeros(slots + 1, 2 * width if int8 else 0, device=device)
        self.lora_a = torch.unflatten(
            self.slot_weights[:, : width * in_features], 1, (width, in_features)
        )
        self.lora_b: list[torch.Tensor] = []  # [slots, R, out_p], int8: [slots, R4 / 4, out_p, 4]
        at = width * in_features
        for size in parts:
            shape = (rows // 4, size, 4) if int8 else (rows, size)
            self.lora_b.append(
                torch.unflatten(self.slot_weights[:, at : at + rows * size], 1, shape)
            )
            at += rows * size
        self.used_slots: set[int] = set()  # slots whose adapter targets this projection
        self.kernels: CpuKernels | None = None  # the model's `use_kernels`
        self._part_sizes = torch.tensor(parts, dtype=torch.long)
        self._part_rank = torch.zeros(slots + 1, len(parts), dtype=torch.int32)  # 0: none
        self._b_pointers = (ctypes.c_void_p * len(parts))(*(b.data_ptr() for b in self.lora_b))
        self._kernel_args: Any = None  # the C kernel's view of these weights (`lora_args`)
        self._kernel_dtypes = stored in (torch.float32, torch.bfloat16, torch.float16, torch.int8)
        self._kernel_dtypes &= device.type == "cpu"

    def load_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's (A [r, in], scaled B [out, r]) per part; None = part untouched."""
        self.slot_weights[slot].zero_()
        self.slot_scales[slot].zero_()
        self.used_slots.discard(slot)
        if any(w is not None for w in weights):
            self.used_slots.add(slot)
        width = len(self.parts) * self.max_rank
        for p, w in enumerate(weights):
            self._part_rank[slot, p] = 0 if w is None else w[0].shape[0]
            if w is None:
                continue
            a, b = w[0], w[1].T
            lo, hi = p * self.max_rank, p * self.max_rank + a.shape[0]
            if self.slot_weights.dtype == torch.int8:
                a, self.slot_scales[slot, lo:hi] = quantize_rows(a)
                b, self.slot_scales[slot, width + lo : width + hi] = quantize_rows(b)
                quads = self.lora_b[p].shape[1]
                b = torch.cat([b, b.new_zeros(4 * quads - b.shape[0], b.shape[1])])
                self.lora_b[p][slot] = b.reshape(quads, 4, -1).transpose(1, 2)
            else:
                self.lora_b[p][slot, : hi - lo] = b.to(self.lora_a.dtype)
            self.lora_a[slot, lo:hi] = a.to(self.lora_a.dtype)

    def dequantized(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A `[slots, P*R, in]` and each part's B `[slots, R, out_p]` in float32, as the C
        kernel reads them (int8 rows times their scales)."""
        every, parts = slice(None), range(len(self.parts))
        return self._a(every, torch.float32), [self._b(p, every, torch.float32) for p in parts]

    def _a(self, slots: torch.Tensor | int | slice, dtype: torch.dtype) -> torch.Tensor:
        a = self.lora_a[slots].to(dtype)
        if self.slot_weights.dtype != torch.int8:
            return a
        width = len(self.parts) * self.max_rank
        return a * self.slot_scales[slots, :width].unsqueeze(-1).to(dtype)

    def _b(self, p: int, slots: torch.Tensor | int | slice, dtype: torch.dtype) -> torch.Tensor:
        b = self.lora_b[p][slots].to(dtype)
        if self.slot_weights.dtype != torch.int8:
            return b
        b = b.transpose(-1, -2).flatten(-3, -2)[..., : self.max_rank, :]  # quads to [R, out]
        at = len(self.parts) * self.max_rank + p * self.max_rank
        return b * self.slot_scales[slots, at : at + self.max_rank].unsqueeze(-1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        batch = self.batch
        if not batch.active or not self.used_slots:  # no loaded adapter targets this one
            return y
        if self.kernels is not None and batch.groups is not None and self._kernel_fits(x, y):
            if self._kernel_args is None:
                self._kernel_args = self.kernels.lora_args(
                    self.lora_a,
                    self._b_pointers,
                    self.slot_weights.stride(0),
                    self._part_sizes,
                    self._part_rank,
                    self.max_rank,
                    self.slot_scales,
                )
            self.kernels.lora_add(x, y, batch.groups, self._kernel_args)
            return y
        rows, row_slots = batch.torch_rows()
        if batch.gathered:
            xs = (x if batch.all_rows else x[rows]).unsqueeze(1)  # [n, 1, in]
            h = torch.bmm(xs.to(self.dtype), self._a(row_slots, self.dtype).transpose(1, 2))
            deltas = [
                torch.bmm(self._part(h, p), self._b(p, row_slots, self.dtype)).squeeze(1)
                for p in range(len(self.lora_b))
            ]
            return self._add(y, rows, deltas, batch.all_rows)
        for slot, seg in batch.segments:
            h = x[seg].to(self.dtype) @ self._a(slot, self.dtype).T
            deltas = [
                self._part(h, p) @ self._b(p, slot, self.dtype) for p in range(len(self.lora_b))
            ]
            self._add(y, seg, deltas)
        return y

    def _kernel_fits(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        as_kernel = (torch.float32, torch.bfloat16)
        return (
            self._kernel_dtypes
            and x.dim() == 2
            and x.stride(1) == 1
            and x.dtype in as_kernel
            and y.dtype in as_kernel
            and y.is_contiguous()
        )

    def _part(self, h: torch.Tensor, p: int) -> torch.Tensor:
        if len(self.lora_b) == 1:
            return h
        return h[..., p * self.max_rank : (p + 1) * self.max_rank]

    def _add(
        self,
        y: torch.Tensor,
        rows: torch.Tensor,
        deltas: list[torch.Tensor],
        all_rows: bool = False,
    ) -> torch.Tensor:
        """y[rows, part p's columns] += deltas[p] (in place; `all_rows`: rows is 0..n-1)."""
        col = 0
        for size, delta in zip(self.parts, deltas, strict=True):
            out = y if len(self.parts) == 1 else y[:, col : col + size]
            if all_rows:
                out.add_(delta.to(y.dtype))
            else:
                out.index_add_(0, rows, delta.to(y.dtype))
            col += size
        return y
