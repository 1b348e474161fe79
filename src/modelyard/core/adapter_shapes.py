"""A PEFT LoRA adapter checked against its base model's shapes at push, never at request time.

The base's dimensions come from its `config.json` (a Hugging Face folder) or its GGUF metadata
(`<arch>.embedding_length`, …); the adapter's from its `adapter_config.json` (rank) and the
header of its `adapter_model.safetensors` (each weight's name and shape). Every weight must
target a projection the engine serves (q/k/v/o, gate/up/down) of a layer the base has, with
A of shape (r, in) and B of (out, r), and r within the serving endpoints' `max_lora_rank`. A
refusal is `Invalid` naming the field: `peft_type` (only LoRA is served), `r`, or
`adapter_model.safetensors` (the tensor and both shapes in the message).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from typing import Any

from modelyard.core.errors import Invalid
from modelyard.core.model_file_limits import (
    INLINE_JSON,
    ModelFileError,
    Reader,
    bounded_json,
    is_int,
    read_exact,
)

SERVED_PEFT_TYPE = "LORA"  # prefix tuning, IA3, LoHa, ... are not served
ADAPTER_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d{1,6})\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.default)?\.weight$"
)
WEIGHTS = "adapter_model.safetensors"
# The dimensions a LoRA's shapes depend on: config.json's name → GGUF's key suffix.
_DIMS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "num_hidden_layers": "block_count",
    "head_dim": "attention.key_length",
}


def dims_from_config(config: Mapping[str, Any]) -> dict[str, int]:
    """A Hugging Face `config.json`'s dimensions (those present, integers only)."""
    return {k: int(config[k]) for k in _DIMS if is_int(config.get(k))}


def dims_from_gguf(meta: Mapping[str, int]) -> dict[str, int]:
    """A GGUF file's dimensions from its integer metadata (`gguf_header.gguf_ints`)."""
    arch_keys = {k.split(".", 1)[1]: v for k, v in meta.items() if "." in k}
    return {k: arch_keys[g] for k, g in _DIMS.items() if g in arch_keys}


def projection_shapes(dims: Mapping[str, int]) -> dict[str, tuple[int, int]] | None:
    """(out, in) of every projection LoRA may target; None if the base's dimensions are
    incomplete (nothing to check against)."""
    try:
        h, i = dims["hidden_size"], dims["intermediate_size"]
        heads = dims["num_attention_heads"]
        kv_heads = dims.get("num_key_value_heads", heads)
        head_dim = dims.get("head_dim") or h // heads
    except (KeyError, ZeroDivisionError):
        return None
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
        "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
    }  # fmt: skip


def safetensors_shapes(reader: Reader, size: int) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from an adapter's safetensors header (already checked at push)."""
    (length,) = struct.unpack("<Q", read_exact(reader, 8, WEIGHTS))
    if length > INLINE_JSON or 8 + length > size:
        raise ModelFileError(WEIGHTS, f"a header of {length} bytes is too large for an adapter")
    header = bounded_json(read_exact(reader, length, WEIGHTS), WEIGHTS)
    if not isinstance(header, dict):
        raise ModelFileError(WEIGHTS, "safetensors header is not a JSON object")
    return {
        name: tuple(entry.get("shape", ()))
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict)
    }


def _refuse(why: str, param: str = WEIGHTS) -> Invalid:
    return Invalid(why, param=param, code="invalid_adapter")


def check_adapter(
    config: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    dims: Mapping[str, int],
    max_rank: int,
) -> int:
    """The adapter's rank once its weights fit the base (`Invalid` naming the field if not)."""
    peft_type = config.get("peft_type")
    if not isinstance(peft_type, str) or peft_type.upper() != SERVED_PEFT_TYPE:
        shown = "missing" if peft_type is None else repr(peft_type)[:100]
        raise _refuse(
            f"adapter_config.json peft_type is {shown}: only LoRA adapters are served "
            f'(peft_type "{SERVED_PEFT_TYPE}", as PEFT writes for a LoraConfig)',
            "peft_type",
        )
    r = config.get("r", 8)
    if not is_int(r) or not 1 <= r <= max_rank:
        raise _refuse(f"adapter_config.json r={r} is outside 1..{max_rank} (max_lora_rank)", "r")
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_dora"):
        raise _refuse("rank_pattern, alpha_pattern and DoRA are not served", "adapter_config.json")
    expected = projection_shapes(dims)
    layers = dims.get("num_hidden_layers")
    parts: dict[tuple[int, str], set[str]] = {}
    for key, shape in shapes.items():
        m = ADAPTER_KEY.match(key)
        if m is None:
            raise _refuse(f"{WEIGHTS}: weight {key[:200]!r} targets no supported projection")
        layer, proj, ab = int(m[1]), m[2], m[3]
        if layers is not None and layer >= layers:
            raise _refuse(f"{WEIGHTS}: {key} names layer {layer}; the base has {layers}")
        parts.setdefault((layer, proj), set()).add(ab)
        if expected is None:
            continue
        out_f, in_f = expected[proj]
        want = (r, in_f) if ab == "A" else (out_f, r)
        if tuple(shape) != want:
            raise _refuse(
                f"{WEIGHTS}: {key} has shape {list(shape)}; the base model with "
                f"adapter_config.json r={r} needs {list(want)}"
            )
    if not parts:
        raise _refuse(f"{WEIGHTS} holds no LoRA weights")
    for (layer, proj), ab in parts.items():
        if ab != {"A", "B"}:
            raise _refuse(f"{WEIGHTS}: layer {layer} {proj} lacks lora_A or lora_B")
    return int(r)
