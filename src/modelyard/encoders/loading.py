"""From a folder to a served encoder: which kind it is, about how much memory it will take before
it is loaded (from its recorded parameter count), the loaded model, and the batch function its
batcher runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from modelyard.encoders.classifier import OnnxClassifier, Scores, SequenceClassifier, onnx_file
from modelyard.encoders.embedding import EmbeddingConfig, EmbeddingModel
from modelyard.encoders.errors import UnsupportedModel

ModelKind = Literal["embedding", "classifier", "onnx-classifier"]
MODEL_KINDS: tuple[str, ...] = get_args(ModelKind)
Encoder = EmbeddingModel | SequenceClassifier | OnnxClassifier
# What one embedding item gives back: its vector (float32 [D]) and its token count.
Embedded = tuple[np.ndarray, int]
# What one classifier item gives back: every label's score, best first, and its token count.
Classified = tuple[Scores, int]


def detect_kind(folder: Path) -> ModelKind:
    """`model.onnx` → ONNX classifier; a `*ForSequenceClassification` config → classifier;
    anything else is read as an embedding model."""
    if not folder.is_dir():
        raise UnsupportedModel(f"{folder} is not a folder")
    if onnx_file(folder) is not None:
        return "onnx-classifier"
    config = folder / "config.json"
    if config.is_file():
        architectures = json.loads(config.read_text()).get("architectures") or []
        if any(str(a).endswith("ForSequenceClassification") for a in architectures):
            return "classifier"
    return "embedding"


def estimate_bytes(kind: ModelKind, folder: Path, param_count: int) -> int:
    """Memory the model will take once loaded: an ONNX model's file sizes; else its parameter
    count as recorded when it was pushed (`core/model_files.py`, never read from a header
    here), loaded as float32; a folder of pytorch `.bin` files only, their size."""
    if kind == "onnx-classifier":
        path = onnx_file(folder)
        if path is None:
            return 0
        return sum(f.stat().st_size for f in path.parent.glob(path.name + "*") if f.is_file())
    if kind == "embedding":
        folder = EmbeddingConfig.read(folder).network_dir
    if any(folder.glob("*.safetensors")):
        return param_count * 4  # loaded as float32
    return sum(w.stat().st_size for w in folder.glob("pytorch_model*.bin"))


def load_encoder(kind: ModelKind, folder: Path, device: str = "cpu") -> Encoder:
    if kind == "embedding":
        return EmbeddingModel(folder, device)
    if kind == "classifier":
        return SequenceClassifier(folder, device)
    if kind == "onnx-classifier":
        return OnnxClassifier(folder)
    raise UnsupportedModel(f"unknown model kind {kind!r} (one of {', '.join(MODEL_KINDS)})")


def batch_function(model: Encoder) -> Callable[[list[Any]], list[Any]]:
    """What the model's batcher runs: one input per item (a text or a token-id list), giving
    `Embedded` for an embedding model and `Classified` for a classifier."""
    if isinstance(model, EmbeddingModel):

        def embed(items: list[str | list[int]]) -> list[Embedded]:
            vectors, counts = model.encode(items)
            return list(zip(vectors.numpy(), counts, strict=True))

        return embed

    def classify(items: list[str]) -> list[Classified]:
        return model.classify_counted(items)

    return classify


def platform(kind: ModelKind) -> str:
    """The runtime's name as Triton spells platforms (model metadata)."""
    return "onnxruntime_onnx" if kind == "onnx-classifier" else "pytorch"


def embedding_dimension(folder: Path) -> int | None:
    """An embedding model's vector size from its files alone (None when they do not say)."""
    config = EmbeddingConfig.read(folder)
    path = config.network_dir / "config.json"
    hidden = json.loads(path.read_text()).get("hidden_size") if path.is_file() else None
    return int(hidden) * len(config.pooling) if hidden else None
