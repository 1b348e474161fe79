"""`LoRAGroups`: a step's adapter rows in the form the C kernel `lora_add` (`csrc/lora.c`) reads
them, grouped by slot. Its own module so that `cpu_kernels` can name it without importing the
LoRA layers, which call the kernels."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoRAGroups:
    """A step's adapter rows for `lora_add`: grouped by slot, at most `GROUP_ROWS` rows of one
    slot per group (they share each read of its weights)."""

    rows: torch.Tensor  # int64, the adapter rows, grouped
    starts: torch.Tensor  # int64 [groups + 1]: group g is rows[starts[g]:starts[g + 1]]
    slots: torch.Tensor  # int64 [groups]
    # What every `lora_add` call of the step passes, read once.
    rows_ptr: int = field(init=False)
    starts_ptr: int = field(init=False)
    slots_ptr: int = field(init=False)
    n_groups: int = field(init=False)

    GROUP_ROWS = 4  # csrc/lora.c's GROUP

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows_ptr", self.rows.data_ptr())
        object.__setattr__(self, "starts_ptr", self.starts.data_ptr())
        object.__setattr__(self, "slots_ptr", self.slots.data_ptr())
        object.__setattr__(self, "n_groups", self.slots.shape[0])

    @classmethod
    def of(cls, by_slot: dict[int, list[int]]) -> LoRAGroups:
        rows: list[int] = []
        starts = [0]
        slots: list[int] = []
        for slot, slot_rows in sorted(by_slot.items()):
            for i in range(0, len(slot_rows), cls.GROUP_ROWS):
                rows.extend(slot_rows[i : i + cls.GROUP_ROWS])
                starts.append(len(rows))
                slots.append(slot)
        long = torch.long
        return cls(torch.tensor(rows, dtype=long), torch.tensor(starts, dtype=long),
                   torch.tensor(slots, dtype=long))  # fmt: skip
