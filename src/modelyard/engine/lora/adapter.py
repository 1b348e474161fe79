"""Read and check one PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`).

An adapter is refused (`AdapterError`, naming why) unless every weight targets a projection the
engine knows (q/k/v/o, gate/up/down) of an existing layer, with the base model's shapes and a
rank within `max_lora_rank`. Scaling (`lora_alpha / r`, or `/ sqrt(r)` with `use_rslora`) is
folded into B here, so the batched kernel is two matmuls.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from modelyard.engine.models.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.default)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot be served on this base model (the message says why)."""


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every projection LoRA may target."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    # (layer, projection) -> (A [r, in], B scaled [out, r])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    fingerprint: str  # of the weights file: a reloaded adapter never reuses stale cache blocks


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise AdapterError(f"{folder.name}: no adapter_config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{folder.name}: adapter_config.json is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise AdapterError(f"{folder.name}: adapter_config.json is not a JSON object")
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{folder.name}: peft_type {raw.get('peft_type')!r} is not LORA")
    return raw


def load_adapter(name: str, folder: Path, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    from safetensors.torch import load_file

    raw = _read_config(folder)
    r = int(raw.get("r", 8))
    if not 1 <= r <= max_rank:
        raise AdapterError(f"{name}: rank r={r} is outside 1..max_lora_rank={max_rank}")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise AdapterError(f"{name}: per-module rank_pattern/alpha_pattern is not supported")
    if raw.get("use_dora"):
        raise AdapterError(f"{name}: DoRA adapters are not supported")
    alpha = float(raw.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if raw.get("use_rslora") else alpha / r
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise AdapterError(f"{name}: no adapter_model.safetensors")
    tensors = load_file(str(path))
    shapes = projection_shapes(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{name}: weight {key!r} targets no supported projection")
        layer, proj, ab = int(m[1]), m[2], m[3]
        if layer >= cfg.num_hidden_layers:
            raise AdapterError(
                f"{name}: {key} names layer {layer}; the base has {cfg.num_hidden_layers}"
            )
        parts.setdefault((layer, proj), {})[ab] = tensor
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{name}: layer {layer} {proj} lacks lora_A or lora_B")
        out_f, in_f = shapes[proj]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
            raise AdapterError(
                f"{name}: layer {layer} {proj} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"the base model needs A ({r}, {in_f}) and B ({out_f}, {r})"
            )
        weights[(layer, proj)] = (a.float(), b.float() * scaling)
    if not weights:
        raise AdapterError(f"{name}: adapter_model.safetensors holds no LoRA weights")
    digest = hashlib.blake2b(path.read_bytes(), digest_size=8).hexdigest()
    return LoRAAdapter(name=name, rank=r, weights=weights, fingerprint=digest)
