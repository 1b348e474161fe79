"""What kind of model a deployed artifact is: a generative LLM (its own engine workers) or an
encoder (an embedding or classifier model in the shared encoder host).

Read from the folder's `config.json` as plain JSON, so deciding costs no torch import; only an
encoder folder asks the encoders' loader (lazily) which encoder kind it is.
"""

from __future__ import annotations

import json
from pathlib import Path

from modelyard.core.errors import Invalid

LLM = "llm"
# Architecture names the encoder host loads as an embedding model (through `AutoModel`): a bare
# encoder (`BertModel`, `XLMRobertaModel`, `T5EncoderModel`) or one saved with its masked-LM head.
_EMBEDDING_SUFFIXES = ("Model", "ForMaskedLM")


class UnknownArchitecture(Invalid):
    """The folder's config names an architecture that neither the engine nor the encoder host
    serves (deploying it would only fail, or serve nonsense, later)."""


def detect(path: Path) -> str:
    """`llm`, or the encoder kind (`embedding`, `classifier`, `onnx-classifier`)."""
    if path.is_file():
        if path.suffix == ".gguf":
            return LLM
        raise ValueError(f"{path}: a single file must be a .gguf model")
    config = path / "config.json"
    raw = json.loads(config.read_text()) if config.is_file() else {}
    architectures = [str(a) for a in raw.get("architectures") or []]
    if any(a.endswith("ForCausalLM") for a in architectures):
        return LLM
    # A torch-free module: the engine's table of the model types it runs.
    from modelyard.engine.models.config import SUPPORTED_ARCHITECTURES

    if not architectures and raw.get("model_type") in SUPPORTED_ARCHITECTURES:
        return LLM
    from modelyard.encoders.loading import detect_kind  # loads torch: only for encoder folders

    kind = detect_kind(path)
    # The encoder host reads any other folder as an embedding model, so refuse one whose
    # config names something else (a seq2seq or a speech model, a non-Llama LM head).
    embeddable = any(a.endswith(_EMBEDDING_SUFFIXES) for a in architectures)
    if kind == "embedding" and architectures and not embeddable:
        raise UnknownArchitecture(
            f"{path.name}/config.json names {', '.join(architectures)}: neither a causal LM "
            "(…ForCausalLM, served by the engine) nor an encoder (…Model, …ForMaskedLM or "
            "…ForSequenceClassification, served by the encoder host)",
            param="model_artifact",
            code="unsupported_architecture",
        )
    return kind
