"""A small classifier made from an embedding model with no training: `make_classifier` writes a
folder that the encoder host serves as an ONNX classifier (`modelyard models make-classifier`).

Each label is described in a few words; the label's vector is the embedding model's vector of
its description. The exported graph embeds a text the way the model does (its network, mean
pooling over the real tokens, L2 normalization) and scores every label by cosine similarity
times `scale` (the logits; the host's softmax turns them into scores). Its quality is that of
the embedding model's similarity: fine for coarse topics and sentiment, not a trained head.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from modelyard.encoders.embedding import EmbeddingConfig, EmbeddingModel
from modelyard.encoders.errors import UnsupportedModel

DEFAULT_LABELS = {
    "positive": "a positive, happy, satisfied review: great, loved it, excellent",
    "negative": "a negative, angry, disappointed review: terrible, hated it, awful",
}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)


class _CosineHead(torch.nn.Module):
    def __init__(self, network: torch.nn.Module, labels: torch.Tensor, scale: float) -> None:
        super().__init__()
        self.network = network
        self.register_buffer("labels", labels)
        self.scale = scale

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.network(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        labels: torch.Tensor = self.labels  # type: ignore[assignment]
        return self.scale * F.normalize(pooled, dim=-1) @ labels.T


def make_classifier(
    embedding_folder: Path, out: Path, labels: dict[str, str], scale: float = 20.0
) -> Path:
    """Write the classifier folder `out` (model.onnx, config.json with the labels, the
    tokenizer); `labels` maps each label to its description."""
    from transformers import AutoModel

    if importlib.util.find_spec("onnx") is None:  # torch's exporter writes through it
        raise UnsupportedModel("exporting the classifier needs the onnx package: pip install onnx")
    if not labels:
        raise UnsupportedModel("a classifier needs at least one label")
    config = EmbeddingConfig.read(embedding_folder)
    if config.pooling != ("mean",):
        raise UnsupportedModel(f"{embedding_folder}: only mean-pooled embedding models")
    embedder = EmbeddingModel(embedding_folder)
    vectors, _ = embedder.encode(list(labels.values()))
    vectors = F.normalize(vectors.float(), dim=-1)
    network = AutoModel.from_pretrained(
        str(config.network_dir), local_files_only=True, attn_implementation="eager"
    ).eval()
    head = _CosineHead(network, vectors, scale).eval()
    out.mkdir(parents=True, exist_ok=True)
    source = config.network_dir
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    names = list(labels)
    model_config = json.loads((source / "config.json").read_text())
    model_config.update(
        architectures=["BertForSequenceClassification"],
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
        num_labels=len(names),
        max_position_embeddings=min(
            int(model_config.get("max_position_embeddings", 512)), embedder.max_length
        ),
    )
    (out / "config.json").write_text(json.dumps(model_config, indent=2))
    export_classifier_onnx(head, out / "model.onnx")
    return out


def export_classifier_onnx(model: torch.nn.Module, path: Path) -> None:
    """A sequence classifier as ONNX: (input_ids, attention_mask, token_type_ids) -> logits,
    batch and sequence dynamic. The TorchScript exporter: offline, and needs no onnxscript; its
    tracer warnings are expected."""
    ids = torch.ones(2, 8, dtype=torch.long)
    inputs = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {n: {0: "batch", 1: "sequence"} for n in inputs}
    axes["logits"] = {0: "batch"}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (ids, torch.ones_like(ids), torch.zeros_like(ids)),
            str(path),
            input_names=inputs,
            output_names=["logits"],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
