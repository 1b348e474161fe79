"""What a deployed model says it is: its kind as clients see it (`core/model_kinds.py`) and its
capabilities, read from its folder's plain JSON files (no torch, no tokenizer load), once per
provisioning, for `/v1/models` and the gateway's wrong-kind check.

Capabilities: `tools` and `structured_outputs` (the engine serves both for any LLM with a chat
template; structured outputs for completions too), `reasoning` (the chat template has a thinking
mode, `<think>`; the worker answers the thinking as `reasoning_content`), `adapters` (the
endpoint serves LoRA adapters) and `max_context` (the longest prompt plus output, in tokens;
null when unknown).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modelyard.config import EngineSettings
from modelyard.control.model_kind import LLM
from modelyard.core.model_kinds import ModelKind

_CONFIG_MAX = 1 << 20  # config files are small; a bigger one is not read


def describe(path: Path, detected: str, engine: EngineSettings) -> tuple[ModelKind, dict[str, Any]]:
    """The kind and capabilities of the model at `path`, whose `model_kind.detect` is
    `detected` (`llm` or an encoder kind), served with `engine`'s settings."""
    config = _json(path / "config.json") if path.is_dir() else {}
    context = _context(config)
    if detected != LLM:
        kind = ModelKind.EMBEDDING if detected == "embedding" else ModelKind.CLASSIFIER
        # A sentence-transformers folder truncates its inputs shorter than the net allows.
        limit = _json(path / "sentence_bert_config.json").get("max_seq_length")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            context = min(limit, context or limit)
        return kind, {"max_context": context}
    template = _chat_template(path)
    chat = template is not None
    return (ModelKind.CHAT if chat else ModelKind.COMPLETION), {
        "tools": chat,
        "structured_outputs": True,
        "reasoning": chat and "<think>" in str(template),
        "adapters": engine.max_loras > 0,
        "max_context": engine.max_model_len or context,
    }


def _json(path: Path) -> dict[str, Any]:
    try:
        if not path.is_file() or path.stat().st_size > _CONFIG_MAX:
            return {}
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _context(config: dict[str, Any]) -> int | None:
    for block in (config, config.get("text_config") or {}):
        if not isinstance(block, dict):
            continue
        value = block.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _chat_template(path: Path) -> Any:
    """The folder's chat template (tokenizer_config.json, else chat_template.jinja), or None; a
    single .gguf file is taken as a chat model (its template is in its metadata, which the worker
    reads)."""
    if path.is_file():
        return "" if path.suffix == ".gguf" else None
    template = _json(path / "tokenizer_config.json").get("chat_template")
    if template:
        return template
    for name in ("chat_template.jinja", "chat_template.json"):
        if (path / name).is_file():
            return name
    return None
