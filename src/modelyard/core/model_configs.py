"""Bounded checks of a pushed model's small JSON configs (`core/model_files.py` runs them).

`config.json` (anywhere in the folder) must be an object whose numbers that sizing and loading
read are integers within `CONFIG_INTS`; `adapter_config.json` an object with a bounded rank,
alpha and target list; the other sentence-transformers and generation configs an object or a
list. Each is at most `MAX_CONFIG_BYTES`, with integers of bounded digits and finite floats.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from modelyard.core.model_file_limits import (
    INLINE_JSON,
    MAX_CONFIG_BYTES,
    MAX_NAME,
    ModelFileError,
    Reader,
    bounded_json,
    in_child,
    is_int,
    read_exact,
)

MAX_LORA_RANK = 1024
MAX_LORA_TARGETS = 64
# config.json numbers the engine and the encoders size or allocate from: (least, greatest).
CONFIG_INTS = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 1 << 12),
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
    "num_labels": (1, 1 << 16),
    "type_vocab_size": (1, 1 << 16),
    # mixture-of-experts (Mixtral, Qwen2-MoE, OLMoE): one module per expert is built at load
    "num_local_experts": (1, 1024),
    "num_experts": (1, 1024),
    "num_experts_per_tok": (1, 1024),
    "moe_intermediate_size": (1, 1 << 20),
    "shared_expert_intermediate_size": (1, 1 << 20),
    "decoder_sparse_step": (1, 1024),
}


def _config(raw: Any, path: str) -> None:
    if not isinstance(raw, dict):
        raise ModelFileError(path, "must be a JSON object")
    for key, (low, high) in CONFIG_INTS.items():
        value = raw.get(key)
        if value is not None and not (is_int(value) and low <= value <= high):
            raise ModelFileError(path, f"{key} must be an integer in [{low}, {high}]")
    architectures = raw.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list)
        and len(architectures) <= 16
        and all(isinstance(a, str) and len(a) <= MAX_NAME for a in architectures)
    ):
        raise ModelFileError(path, f"architectures must be ≤ 16 names of ≤ {MAX_NAME} chars")
    model_type = raw.get("model_type")
    if model_type is not None and not (isinstance(model_type, str) and len(model_type) <= 128):
        raise ModelFileError(path, "model_type must be a name of ≤ 128 chars")


def _adapter_config(raw: Any, path: str) -> None:
    if not isinstance(raw, dict):
        raise ModelFileError(path, "must be a JSON object")
    r = raw.get("r", 8)
    if not (is_int(r) and 1 <= r <= MAX_LORA_RANK):
        raise ModelFileError(path, f"r must be an integer in [1, {MAX_LORA_RANK}]")
    alpha = raw.get("lora_alpha")
    if alpha is not None and not (
        isinstance(alpha, int | float) and not isinstance(alpha, bool) and abs(alpha) <= 1e6
    ):
        raise ModelFileError(path, "lora_alpha must be a number of magnitude ≤ 1e6")
    targets = raw.get("target_modules")
    if isinstance(targets, str):  # PEFT's regex form
        if len(targets) > 4096:
            raise ModelFileError(path, "target_modules as a pattern is limited to 4096 chars")
    elif targets is not None and not (
        isinstance(targets, list)
        and len(targets) <= MAX_LORA_TARGETS
        and all(isinstance(t, str) and len(t) <= MAX_NAME for t in targets)
    ):
        raise ModelFileError(
            path, f"target_modules must be ≤ {MAX_LORA_TARGETS} names of ≤ {MAX_NAME} chars"
        )


def check_config(reader: Reader, size: int, path: str) -> None:
    """A small JSON config: its size, an object, and (config.json, adapter_config.json) the
    fields sizing and loading read."""
    if size > MAX_CONFIG_BYTES:
        raise ModelFileError(path, f"{size} bytes (limit {MAX_CONFIG_BYTES} for a JSON config)")
    raw = read_exact(reader, size, path)
    if size > INLINE_JSON:
        in_child("config", raw, size, path)
    else:
        check_config_bytes(raw, path)


def check_config_bytes(content: bytes, path: str) -> None:
    raw = bounded_json(content, path)
    name = PurePosixPath(path).name
    if name == "adapter_config.json":
        _adapter_config(raw, path)
    elif name == "config.json":
        _config(raw, path)
    elif not isinstance(raw, dict | list):
        raise ModelFileError(path, "must be a JSON object or list")
