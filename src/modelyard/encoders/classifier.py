"""Sequence classifiers: a transformers `*ForSequenceClassification` folder (`SequenceClassifier`)
or its ONNX export run by onnxruntime on the CPU (`OnnxClassifier`), both giving every label's
score, best first.

Scores are the softmax of the logits, or per-label sigmoids where the config's `problem_type` is
`multi_label_classification` (labels there are not exclusive). Labels come from `config.id2label`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modelyard.encoders.errors import UnsupportedModel
from modelyard.encoders.tokens import Batch, InputTokenizer, config_max_length

Scores = list[tuple[str, float]]
_ONNX_FEEDS = ("input_ids", "attention_mask", "token_type_ids")


def _labels(config: Any) -> list[str]:
    id2label = {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
    n = int(getattr(config, "num_labels", 0) or len(id2label))
    return [id2label.get(i, f"LABEL_{i}") for i in range(n)]


def _probabilities(logits: np.ndarray, multi_label: bool) -> np.ndarray:
    logits = logits.astype(np.float64)
    if multi_label:
        sigmoid: np.ndarray = 1.0 / (1.0 + np.exp(-logits))
        return sigmoid
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    softmax: np.ndarray = shifted / shifted.sum(axis=1, keepdims=True)
    return softmax


class _Classifier:
    labels: list[str]
    tokenizer: InputTokenizer
    multi_label: bool
    platform: str

    def _setup(self, folder: Path, config: Any) -> None:
        self.labels = _labels(config)
        if not self.labels:
            raise UnsupportedModel(f"{folder}: config.json declares no labels")
        self.multi_label = getattr(config, "problem_type", None) == "multi_label_classification"
        self.tokenizer = InputTokenizer(folder)
        self.tokenizer.max_length = config_max_length(config, self.tokenizer.tokenizer)

    @property
    def max_length(self) -> int:
        return self.tokenizer.max_length

    def _logits(self, batch: Batch) -> np.ndarray:
        raise NotImplementedError

    def classify(self, texts: Sequence[str]) -> list[Scores]:
        """Every label with its score, best first, for each text (one batch: callers batch)."""
        return [scores for scores, _ in self.classify_counted(texts)]

    def classify_counted(self, texts: Sequence[str]) -> list[tuple[Scores, int]]:
        """`classify`, each text's scores with its token count (what it is billed)."""
        batch = self.tokenizer.batch(self.tokenizer.ids(texts))
        probabilities = _probabilities(self._logits(batch), self.multi_label)
        return [
            (sorted(zip(self.labels, map(float, row), strict=True), key=lambda p: -p[1]), n)
            for row, n in zip(probabilities, batch.lengths, strict=True)
        ]


class SequenceClassifier(_Classifier):
    platform = "pytorch"

    def __init__(self, folder: str | Path, device: str = "cpu") -> None:
        from transformers import AutoModelForSequenceClassification

        self.folder = Path(folder)
        self.device = torch.device(device)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(self.folder), local_files_only=True, dtype=torch.float32
        )
        self.model.to(self.device).eval()
        self._setup(self.folder, self.model.config)
        self._takes_token_types = (
            "token_type_ids" in inspect.signature(self.model.forward).parameters
        )

    def _logits(self, batch: Batch) -> np.ndarray:
        kwargs = {
            "input_ids": torch.from_numpy(batch.input_ids).to(self.device),
            "attention_mask": torch.from_numpy(batch.attention_mask).to(self.device),
        }
        if self._takes_token_types:
            kwargs["token_type_ids"] = torch.from_numpy(batch.token_type_ids).to(self.device)
        with torch.inference_mode():
            logits: np.ndarray = self.model(**kwargs).logits.float().cpu().numpy()
        return logits

    def memory_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)


def onnx_file(folder: Path) -> Path | None:
    """`model.onnx` at the folder's root or in its `onnx/` subfolder (Optimum's layout)."""
    for candidate in (folder / "model.onnx", folder / "onnx" / "model.onnx"):
        if candidate.is_file():
            return candidate
    return None


class OnnxClassifier(_Classifier):
    platform = "onnxruntime_onnx"

    def __init__(self, folder: str | Path, num_threads: int | None = None) -> None:
        import onnxruntime
        from transformers import AutoConfig

        self.folder = Path(folder)
        path = onnx_file(self.folder)
        if path is None:
            raise UnsupportedModel(f"{self.folder}: no model.onnx")
        self.path = path
        options = onnxruntime.SessionOptions()
        if num_threads:
            options.intra_op_num_threads = num_threads
        self.session = onnxruntime.InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"]
        )
        self.feeds = [i.name for i in self.session.get_inputs()]
        unknown = [name for name in self.feeds if name not in _ONNX_FEEDS]
        if unknown:
            raise UnsupportedModel(f"{path}: unexpected graph inputs {unknown}")
        outputs = [o.name for o in self.session.get_outputs()]
        self.output = "logits" if "logits" in outputs else outputs[0]
        self._setup(
            self.folder, AutoConfig.from_pretrained(str(self.folder), local_files_only=True)
        )

    def _logits(self, batch: Batch) -> np.ndarray:
        arrays = {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            "token_type_ids": batch.token_type_ids,
        }
        (logits,) = self.session.run([self.output], {name: arrays[name] for name in self.feeds})
        return np.asarray(logits, dtype=np.float32)

    def memory_bytes(self) -> int:
        """The graph file and its external weights: what the session holds as initializers."""
        files = [
            self.path,
            *self.path.parent.glob(self.path.name + "?data"),
            *self.path.parent.glob(self.path.name + "_data"),
        ]
        return sum(f.stat().st_size for f in files if f.is_file())
