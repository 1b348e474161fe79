"""Batched per-row LoRA on a model's linear projections (no weight merging).

Each wrapped projection keeps stacked weights for every slot: A `[slots, in, P*R]` (P =
projections fused into this matmul, e.g. 3 for qkv, R = max rank; part p's A in columns
p*R..p*R+R) and one B per part, `[slots, R, out_p]` (no block-diagonal padding: a part's update
reads only its own B). Slot 0 is the base model and is never computed. A step sets `LoRABatch`
once: which flat-batch rows use which slot. Then every wrapped projection adds
`x[rows] @ A[slot] @ B[slot]` for its adapter rows:

- grouped (CPU): the adapter rows sorted by slot, one segmented matmul (`torch._grouped_mm`)
  for A and one per part for B, each reading every slot's weights in place: the cost is one read
  of the weights of the adapters in the step, whatever their number;
- otherwise one gathered `bmm` (many adapters, one row each: decoding) or one matmul pair per
  adapter (segmented: long prefill chunks of few adapters). A projection whose shapes the
  grouped kernel refuses (strides not a multiple of 16 bytes) falls back to these.

A step without adapter rows costs one attribute check per projection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

_GROUPED = hasattr(torch, "_grouped_mm")


@dataclass
class LoRABatch:
    """The current step's rows per slot; shared by every wrapped projection."""

    active: bool = False
    rows: torch.Tensor | None = None  # flat-batch rows using an adapter
    row_slots: torch.Tensor | None = None  # their slot indices (gathered mode)
    segments: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (slot, rows)
    gathered: bool = False
    all_rows: bool = False  # every row uses an adapter: no row selection, add in place
    grouped: bool = False  # segmented matmuls over rows sorted by slot
    order: torch.Tensor | None = None  # adapter rows sorted by slot (grouped mode)
    offs: torch.Tensor | None = None  # int32 end of each slot's rows in `order`
    # Grouped mode where the kernel exists and is fast (on CUDA it needs recent GPUs: the
    # gathered/segmented path stays there).
    allow_grouped: bool = True

    def set(self, token_slots: list[int], device: torch.device, slots: int = 0) -> None:
        rows = [i for i, s in enumerate(token_slots) if s]
        self.active = bool(rows)
        if not rows:
            self.rows = self.row_slots = self.order = self.offs = None
            self.segments = []
            return
        by_slot: dict[int, list[int]] = {}
        for i in rows:
            by_slot.setdefault(token_slots[i], []).append(i)
        as_long = {"dtype": torch.long, "device": device}
        self.all_rows = len(rows) == len(token_slots)
        self.grouped = _GROUPED and self.allow_grouped and device.type == "cpu" and slots > 0
        if self.grouped:
            order = [i for s in sorted(by_slot) for i in by_slot[s]]
            counts = [len(by_slot.get(s, ())) for s in range(slots + 1)]
            ends, total = [], 0
            for c in counts:
                total += c
                ends.append(total)
            self.order = torch.tensor(order, **as_long)
            self.offs = torch.tensor(ends, dtype=torch.int32, device=device)
        # Few adapters with many rows each: a matmul pair per adapter beats gathering A and B
        # per row; one row each (decode with many adapters): one bmm over gathered weights.
        self.gathered = len(rows) < 4 * len(by_slot)
        self.rows = torch.tensor(rows, **as_long)
        self.row_slots = torch.tensor([token_slots[i] for i in rows], **as_long)
        self.segments = [(s, torch.tensor(r, **as_long)) for s, r in by_slot.items()]

    def clear(self) -> None:
        self.set([], torch.device("cpu"))


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
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.max_rank = max_rank
        self.batch = batch
        width = len(parts) * max_rank
        self.lora_a = torch.zeros(slots + 1, in_features, width, dtype=dtype, device=device)
        self.lora_b = [
            torch.zeros(slots + 1, max_rank, size, dtype=dtype, device=device) for size in parts
        ]
        self.used_slots: set[int] = set()  # slots whose adapter targets this projection
        self.grouped_ok = True  # until the grouped kernel refuses these shapes

    def load_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's (A [r, in], scaled B [out, r]) per part; None = part untouched."""
        self.lora_a[slot].zero_()
        for b in self.lora_b:
            b[slot].zero_()
        self.used_slots.discard(slot)
        if any(w is not None for w in weights):
            self.used_slots.add(slot)
        for p, w in enumerate(weights):
            if w is not None:
                a, b = w
                r = a.shape[0]
                lo = p * self.max_rank
                self.lora_a[slot, :, lo : lo + r] = a.T.to(self.lora_a.dtype)
                self.lora_b[p][slot, :r] = b.T.to(self.lora_a.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if not batch.active or not self.used_slots:  # no loaded adapter targets this one
            return y
        if batch.grouped and self.grouped_ok:
            try:
                return self._grouped(x, y)
            except RuntimeError:  # shapes the kernel refuses (alignment): gathered from now on
                self.grouped_ok = False
        assert batch.rows is not None and batch.row_slots is not None
        if batch.gathered:
            xs = (x if batch.all_rows else x[batch.rows]).unsqueeze(1)  # [n, 1, in]
            h = torch.bmm(xs.to(self.lora_a.dtype), self.lora_a[batch.row_slots])
            deltas = [
                torch.bmm(self._part(h, p), b[batch.row_slots]).squeeze(1)
                for p, b in enumerate(self.lora_b)
            ]
            return self._add(y, batch.rows, deltas, batch.all_rows)
        for slot, rows in batch.segments:
            h = x[rows].to(self.lora_a.dtype) @ self.lora_a[slot]
            self._add(y, rows, [self._part(h, p) @ b[slot] for p, b in enumerate(self.lora_b)])
        return y

    def _grouped(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        assert batch.order is not None and batch.offs is not None
        xs = x[batch.order].to(self.lora_a.dtype)  # adapter rows, sorted by slot
        h = torch._grouped_mm(xs, self.lora_a, offs=batch.offs)
        deltas = [
            torch._grouped_mm(self._part(h, p).contiguous(), b, offs=batch.offs)
            for p, b in enumerate(self.lora_b)
        ]
        return self._add(y, batch.order, deltas)

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
