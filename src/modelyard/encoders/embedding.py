"""`EmbeddingModel`: a sentence-transformers (or plain BERT-family) folder turned into vectors,
pooled and normalized the way the folder's own files say.

Read from the folder: `modules.json` (a `Normalize` module means L2-normalize; the Transformer
module's path says where the network lives), the pooling module's `config.json`
(`pooling_mode_*`), `sentence_bert_config.json` (`max_seq_length`) and
`config_sentence_transformers.json`. A plain BERT folder without those files gets mean pooling,
no normalization and the network's own length limit. Modules beyond Transformer, Pooling and
Normalize (Dense projections…) are refused rather than silently skipped.

Matryoshka truncation (OpenAI's `dimensions`) is allowed only where the folder declares it:
`"matryoshka_dimensions": [...]` (or `"matryoshka_dims"`, or `"matryoshka": true`) in
`config_sentence_transformers.json` or the pooling config. There is no standard key for it, and a
model not trained for truncation gives poor vectors when truncated, so undeclared means refused.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from modelyard.encoders.errors import DimensionsNotSupported, UnsupportedModel
from modelyard.encoders.tokens import Inputs, InputTokenizer, config_max_length

# sentence-transformers concatenates several pooled vectors in this order.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")
_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST = "sentence_transformers.models."
_MATRYOSHKA_KEYS = ("matryoshka_dimensions", "matryoshka_dims", "matryoshka")


def _read_json(path: Path) -> dict[str, Any] | list[Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class EmbeddingConfig:
    """What the folder's sentence-transformers files declare."""

    network_dir: Path
    pooling: tuple[str, ...]
    normalize: bool
    max_seq_length: int | None
    matryoshka: bool

    @classmethod
    def read(cls, folder: Path) -> EmbeddingConfig:
        modules = _read_json(folder / "modules.json")
        if not isinstance(modules, list):
            return cls(folder, ("mean",), False, None, False)
        network_dir, pooling_dir, normalize = folder, None, False
        for module in modules:
            kind = str(module.get("type", ""))
            path = folder / str(module.get("path", ""))
            if kind == _ST + "Transformer":
                network_dir = path
            elif kind == _ST + "Pooling":
                pooling_dir = path
            elif kind == _ST + "Normalize":
                normalize = True
            else:
                raise UnsupportedModel(
                    f"{folder}: sentence-transformers module {kind!r} is not "
                    "supported (only Transformer, Pooling, Normalize)"
                )
        pooling_config = _read_json(pooling_dir / "config.json") if pooling_dir else None
        pooling_config = pooling_config if isinstance(pooling_config, dict) else {}
        st_config = _read_json(folder / "config_sentence_transformers.json")
        st_config = st_config if isinstance(st_config, dict) else {}
        bert_config = _read_json(network_dir / "sentence_bert_config.json")
        max_seq = bert_config.get("max_seq_length") if isinstance(bert_config, dict) else None
        matryoshka = any(
            bool(config.get(key))
            for config in (st_config, pooling_config)
            for key in _MATRYOSHKA_KEYS
        )
        return cls(
            network_dir,
            _pooling_modes(pooling_config, folder),
            normalize,
            int(max_seq) if max_seq else None,
            matryoshka,
        )


def _pooling_modes(config: dict[str, Any], folder: Path) -> tuple[str, ...]:
    if config.get("pooling_mode_weightedmean_tokens"):
        raise UnsupportedModel(f"{folder}: weighted-mean pooling is not supported")
    named = config.get("pooling_mode")
    if isinstance(named, str):  # newer sentence-transformers write the mode by name
        mode = {"mean_sqrt_len_tokens": "mean_sqrt_len"}.get(named, named)
        if mode not in POOLING_MODES:
            raise UnsupportedModel(f"{folder}: pooling mode {named!r} is not supported")
        return (mode,)
    chosen = {mode for key, mode in _POOLING_KEYS.items() if config.get(key)}
    return tuple(m for m in POOLING_MODES if m in chosen) or ("mean",)


def pool(
    hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, modes: Sequence[str]
) -> torch.Tensor:
    """sentence-transformers' pooling of right-padded `hidden` [N, L, H] under `mask` [N, L]."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode == "max":
            parts.append(hidden.masked_fill(m == 0, -1e9).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len"):
            summed = (hidden * m).sum(dim=1)
            count = m.sum(dim=1).clamp(min=1e-9)
            parts.append(summed / (count if mode == "mean" else count.sqrt()))
        elif mode == "lasttoken":
            parts.append(hidden[torch.arange(hidden.shape[0]), lengths - 1])
        else:
            raise UnsupportedModel(f"pooling mode {mode!r} is not supported")
    return torch.cat(parts, dim=1)


class EmbeddingModel:
    """A text encoder from a local folder; `encode` runs one batch (callers batch)."""

    def __init__(self, folder: str | Path, device: str = "cpu") -> None:
        from transformers import AutoModel

        self.folder = Path(folder)
        self.config = EmbeddingConfig.read(self.folder)
        self.device = torch.device(device)
        self.model = AutoModel.from_pretrained(
            str(self.config.network_dir), local_files_only=True, dtype=torch.float32
        )
        self.model.to(self.device).eval()
        tokenizer = InputTokenizer(self.config.network_dir)
        network_limit = config_max_length(self.model.config, tokenizer.tokenizer)
        tokenizer.max_length = min(self.config.max_seq_length or network_limit, network_limit)
        self.tokenizer = tokenizer
        self._takes_token_types = (
            "token_type_ids" in inspect.signature(self.model.forward).parameters
        )
        self.dimension = int(self.model.config.hidden_size) * len(self.config.pooling)

    @property
    def max_length(self) -> int:
        return self.tokenizer.max_length

    @property
    def supports_dimensions(self) -> bool:
        return self.config.matryoshka

    def encode(self, inputs: Inputs) -> tuple[torch.Tensor, list[int]]:
        """Vectors (float32 [N, D], on the CPU) and token counts of texts or token-id lists."""
        ids = self.tokenizer.ids(inputs)
        batch = self.tokenizer.batch(ids)
        kwargs = {
            "input_ids": torch.from_numpy(batch.input_ids).to(self.device),
            "attention_mask": torch.from_numpy(batch.attention_mask).to(self.device),
        }
        if self._takes_token_types:
            kwargs["token_type_ids"] = torch.from_numpy(batch.token_type_ids).to(self.device)
        with torch.inference_mode():
            hidden = self.model(**kwargs)[0].float()
            lengths = torch.tensor(batch.lengths, device=self.device)
            vectors = pool(hidden, kwargs["attention_mask"], lengths, self.config.pooling)
            if self.config.normalize:
                vectors = F.normalize(vectors, p=2, dim=1)
        return vectors.cpu(), batch.lengths

    def check_dimensions(self, dimensions: int) -> None:
        if not self.supports_dimensions:
            raise DimensionsNotSupported(
                f"'dimensions' is not supported by this model: it declares no Matryoshka "
                f"training, so its {self.dimension}-dimensional vectors cannot be shortened"
            )
        if not 1 <= dimensions <= self.dimension:
            raise DimensionsNotSupported(
                f"'dimensions' must be between 1 and {self.dimension} for this model"
            )

    def truncate(self, vectors: torch.Tensor, dimensions: int) -> torch.Tensor:
        """Matryoshka truncation: the first `dimensions` components, re-normalized if the model
        normalizes (a truncated unit vector is no longer one)."""
        self.check_dimensions(dimensions)
        short = vectors[:, :dimensions]
        return F.normalize(short, p=2, dim=1) if self.config.normalize else short

    def memory_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)
