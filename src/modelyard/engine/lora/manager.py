"""`LoRAManager`: which adapters sit in the engine's `max_loras` slots, and which rows use them.

A request names an adapter; `read` reads and checks it (from a registered path or
`lora_dir/<name>`) on a thread of the worker's edge before the request reaches the engine
(`engine_hooks.AdapterReads`), so the engine's loop does not wait on disk reads. `namespace`
(on the engine's thread) reads one itself only when that read is missing (an engine used
without the client; the adapter evicted or dropped in between), and `try_acquire` puts it
into a free slot or the least recently used one that no live request holds. An adapter held by
a request still in the engine is never evicted; when every slot is held `try_acquire` says no
and the request waits (`engine_hooks.AdapterWaitlist`) until a holder finishes. Each step,
`set_rows` tells the wrapped projections (`layers.LoRALinear`) which flat-batch rows use which
slot.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Collection
from pathlib import Path

import torch

from modelyard.engine.faults import RequestFailed
from modelyard.engine.lora.adapter import (
    AdapterError,
    LoRAAdapter,
    load_adapter,
    projection_shapes,
)
from modelyard.engine.lora.layers import LoRABatch, LoRALinear, weight_dtype
from modelyard.engine.models.config import ModelConfig
from modelyard.engine.models.llama import LlamaForCausalLM

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# wrapped attribute -> the adapter projections fused into it, in output order
_WRAPPED = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}


class LoRASlotsBusy(RequestFailed):
    """Every adapter slot is held by a running request (only `acquire` raises it; the engine
    queues such requests instead)."""


class LoRAManager:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        lora_dir: Path | None = None,
        weights: torch.dtype | None = None,  # how the slots keep them: `weight_dtype` if None
    ) -> None:
        self.cfg = cfg
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.lora_dir = lora_dir
        self.registry_dir: Path | None = None  # registry adapters the platform put on the node
        self.paths: dict[str, Path] = {}
        self.batch = LoRABatch()
        self._slots: OrderedDict[str, int] = OrderedDict()  # loaded name -> slot, LRU first
        self._keys: dict[str, str] = {}  # loaded name -> prefix-cache namespace
        self._holders: dict[str, str] = {}  # request id -> adapter name
        # Read from disk, waiting for a slot: at most `max_loras`, the oldest dropped first (read
        # again if its request comes); written by the edge's reads and the engine's thread.
        self._staged: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._staged_lock = threading.Lock()
        self._read_lock = threading.Lock()  # one read at a time: none read twice at once
        self.loads = 0
        self.evictions = 0
        self.weight_dtype = torch.float32  # how the slots keep weights (set by `_wrap`)
        self._layers = self._wrap(model, weights)

    def _wrap(
        self, model: LlamaForCausalLM, weights: torch.dtype | None
    ) -> list[dict[str, LoRALinear]]:
        param = next(model.parameters())
        dtype, device = param.dtype, param.device
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            dtype = torch.float32
        self.weight_dtype = weights or weight_dtype(dtype, device)
        shapes = {
            "qkv_proj": self.cfg.hidden_size,
            "o_proj": self.cfg.num_attention_heads * self.cfg.head_dim,
            "gate_up_proj": self.cfg.hidden_size,
            "down_proj": self.cfg.intermediate_size,
        }
        outs = projection_shapes(self.cfg)
        layers: list[dict[str, LoRALinear]] = []
        for layer in model.model.decoder_layers():
            wrapped: dict[str, LoRALinear] = {}
            for attr, (owner_name, projs) in _WRAPPED.items():
                owner = getattr(layer, owner_name)
                base = getattr(owner, attr)
                if base is None:
                    raise ValueError("LoRA needs the fused projections (fuse_projections)")
                lin = LoRALinear(
                    base,
                    shapes[attr],
                    [outs[p][0] for p in projs],
                    self.max_loras,
                    self.max_rank,
                    self.batch,
                    dtype,
                    device,
                    self.weight_dtype,
                )
                setattr(owner, attr, lin)
                wrapped[attr] = lin
            layers.append(wrapped)
        return layers

    # ----- adapters and slots ---------------------------------------------------------------

    def register(self, name: str, path: Path) -> None:
        """Make `name` resolvable to a PEFT adapter folder (besides `lora_dir/<name>` and
        `registry_dir/<name>`)."""
        if not ADAPTER_NAME.match(name):
            raise AdapterError(f"adapter name {name!r} must match {ADAPTER_NAME.pattern}")
        self.paths[name] = Path(path)

    def resolve(self, name: str) -> Path:
        """The adapter folder `name` names (`AdapterError` if none)."""
        if not ADAPTER_NAME.match(name):
            raise AdapterError(f"adapter name {name!r} must match {ADAPTER_NAME.pattern}")
        if name in self.paths:
            return self.paths[name]
        for folder in (self.lora_dir, self.registry_dir):
            if folder is not None and (folder / name).is_dir():
                return folder / name
        raise AdapterError(f"unknown adapter {name!r}")

    @property
    def loaded(self) -> list[str]:
        """Loaded adapters, least recently used first."""
        return list(self._slots)

    def in_slot(self, name: str) -> bool:
        """Whether `name` is loaded (safe from any thread: one dict lookup)."""
        return name in self._slots

    def cache_key(self, name: str) -> str:
        return self._keys[name]

    def read(self, name: str) -> None:
        """Read and check adapter `name` from disk for a request about to reach the engine,
        unless it is in a slot or read already; off the engine's thread (the worker's edge).
        `AdapterError` if it cannot be served (the engine's `namespace` says so again)."""
        with self._read_lock:
            if name in self._slots or self._staged_adapter(name) is not None:
                return
            self._stage(name, self._load(name))

    def namespace(self, name: str) -> str:
        """The prefix-cache namespace of adapter `name` (its name and weights fingerprint),
        reading and checking it from disk unless it is in a slot or was read (`AdapterError`
        if it cannot be served). A read adapter is kept until it gets a slot (up to
        `max_loras` of them waiting)."""
        if name in self._slots:
            return self._keys[name]
        adapter = self._staged_adapter(name)
        if adapter is None:
            adapter = self._load(name)
            self._stage(name, adapter)
        return f"{name}@{adapter.fingerprint}"

    def _load(self, name: str) -> LoRAAdapter:
        adapter = load_adapter(name, self.resolve(name), self.cfg, self.max_rank)
        self._check_range(adapter)
        return adapter

    def _staged_adapter(self, name: str) -> LoRAAdapter | None:
        with self._staged_lock:
            return self._staged.get(name)

    def _stage(self, name: str, adapter: LoRAAdapter) -> None:
        with self._staged_lock:
            self._staged[name] = adapter
            self._staged.move_to_end(name)
            while len(self._staged) > self.max_loras:
                self._staged.popitem(last=False)

    def _check_range(self, adapter: LoRAAdapter) -> None:
        """`AdapterError` if the slots' dtype cannot hold the adapter's (scaled) weights."""
        if self.weight_dtype != torch.float16:
            return
        limit = torch.finfo(torch.float16).max
        for (layer, proj), pair in adapter.weights.items():
            if any(not bool((w.abs() <= limit).all()) for w in pair):
                raise AdapterError(
                    f"{adapter.name}: layer {layer} {proj} has weights beyond float16's range "
                    "(this engine keeps the adapters of a float32 model in float16)"
                )

    def try_acquire(self, request_id: str, name: str, live: Collection[str]) -> bool:
        """Hold `name`'s slot for `request_id`, loading it into a free slot or the least recently
        used one nobody holds; False (nothing changed) while every slot is held. `live` = the
        ids of the requests still in the engine (holds of the others are dropped first)."""
        for rid in [r for r in self._holders if r not in live]:
            del self._holders[rid]
        if name not in self._slots:
            self.namespace(name)  # reads it if no read is staged
            slot = self._free_slot()
            if slot is None:
                slot = self._evict()
                if slot is None:
                    return False
            with self._staged_lock:
                adapter = self._staged.pop(name, None)
            if adapter is None:  # dropped by a newer read in the meantime
                adapter = self._load(name)
            self._write(slot, adapter)
            self._slots[name] = slot
            self._keys[name] = f"{name}@{adapter.fingerprint}"
            self.loads += 1
        self._slots.move_to_end(name)
        self._holders[request_id] = name
        return True

    def acquire(self, request_id: str, name: str, live: Collection[str]) -> int:
        """The slot of `name` for `request_id`; `LoRASlotsBusy` while every slot is held."""
        if not self.try_acquire(request_id, name, live):
            raise LoRASlotsBusy(
                f"all {self.max_loras} LoRA slots hold adapters of running requests; retry later"
            )
        return self._slots[name]

    def _free_slot(self) -> int | None:
        used = set(self._slots.values())
        return next((s for s in range(1, self.max_loras + 1) if s not in used), None)

    def _evict(self) -> int | None:
        held = set(self._holders.values())
        for name in self._slots:  # least recently used first
            if name not in held:
                slot = self._slots.pop(name)
                self._keys.pop(name, None)
                self.evictions += 1
                return slot
        return None

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for i, wrapped in enumerate(self._layers):
            for attr, (_, projs) in _WRAPPED.items():
                wrapped[attr].load_slot(slot, [adapter.weights.get((i, p)) for p in projs])

    def slot_of(self, request_id: str) -> int:
        name = self._holders.get(request_id)
        return 0 if name is None else self._slots.get(name, 0)

    # ----- per step -------------------------------------------------------------------------

    def set_rows(self, token_slots: list[int], device: torch.device) -> None:
        self.batch.set(token_slots, device)
