"""What kind of model a deployed artifact is: a generative LLM (its own engine workers) or an
encoder (an embedding or classifier model in the shared encoder host)."""

from __future__ import annotations

import json
from pathlib import Path

from modelyard.encoders.loading import detect_kind
from modelyard.engine.models.config import SUPPORTED_ARCHITECTURES

LLM = "llm"


def detect(path: Path) -> str:
    """`llm`, or the encoder kind (`embedding`, `classifier`, `onnx-classifier`)."""
    if path.is_file():
        if path.suffix == ".gguf":
            return LLM
        raise ValueError(f"{path}: a single file must be a .gguf model")
    config = path / "config.json"
    if config.is_file():
        raw = json.loads(config.read_text())
        architectures = [str(a) for a in raw.get("architectures") or []]
        if any(a.endswith("ForCausalLM") for a in architectures):
            return LLM
        if not architectures and raw.get("model_type") in SUPPORTED_ARCHITECTURES:
            return LLM
    return detect_kind(path)
