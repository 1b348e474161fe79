"""`modelyard models make-classifier`: a classifier folder made from an embedding model with no
training, served by the encoder host as an ONNX classifier; each text's scores are the softmax of
its cosine similarity to each label's description, times the scale."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from modelyard.cli import app
from modelyard.encoders.classifier import OnnxClassifier
from modelyard.encoders.embedding import EmbeddingModel
from modelyard.encoders.loading import detect_kind
from tests.tiny_encoders import build_embedding_model

LABELS = {"fox": "the quick brown fox", "qubit": "quantum computing uses qubits"}
TEXTS = ["a lazy dog and a fox", "qubits in a quantum computer", "hello world"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_embedding_model(tmp_path_factory.mktemp("zero-shot") / "embedder")


def test_make_classifier_scores_by_similarity_to_the_labels(embedder: Path, tmp_path: Path):
    out = tmp_path / "clf"
    args = ["models", "make-classifier", str(out), "--from", str(embedder)]
    for name, words in LABELS.items():
        args += ["--label", f"{name}={words}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert detect_kind(out) == "onnx-classifier"
    classifier = OnnxClassifier(out)
    assert classifier.labels == list(LABELS)
    model = EmbeddingModel(embedder)
    texts, _ = model.encode(TEXTS)
    labels, _ = model.encode(list(LABELS.values()))
    logits = 20.0 * texts.numpy() @ labels.numpy().T  # both normalized: cosine similarities
    want = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    for row, scores in zip(want, classifier.classify(TEXTS), strict=True):
        got = dict(scores)
        assert np.allclose([got[name] for name in LABELS], row, atol=1e-4)


def test_make_classifier_refuses_a_malformed_label(embedder: Path, tmp_path: Path) -> None:
    args = ["models", "make-classifier", str(tmp_path / "x"), "--from", str(embedder)]
    result = CliRunner().invoke(app, [*args, "--label", "no-words"])
    assert result.exit_code == 2 and "NAME=WORDS" in result.output
    result = CliRunner().invoke(app, [*args[:3], "--from", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "does not exist" in result.output
