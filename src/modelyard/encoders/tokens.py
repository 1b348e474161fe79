"""Inputs (texts or token-id lists) to padded batches for an encoder, refusing long inputs.

Nothing is truncated: an input longer than the model's limit is an `InputTooLong` naming its
index. Token-id inputs are the text's tokens without special tokens (as `tokenizer.encode(text,
add_special_tokens=False)` gives them, and as OpenAI's token-id inputs carry none); the model's own
special tokens ([CLS] … [SEP], <s> … </s>) are added around them, so they give the same vector as
the text they came from. Ids no text gives (special and reserved tokens) are refused: they are the
mark of ids made by another tokenizer (OpenAI's, sent by LangChain's `OpenAIEmbeddings`), whose
vectors would be meaningless; ids that another tokenizer happens to share are not caught.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from modelyard.encoders.errors import (
    ForeignTokenId,
    InputTooLong,
    InputTooManyChars,
    InvalidTokenId,
)

# Tokenizers without a real limit report a huge sentinel as their model_max_length.
_NO_LIMIT = 10**6
# Families whose position ids start after the padding id, so max_position_embeddings overstates.
_OFFSET_POSITIONS = {"roberta", "xlm-roberta", "camembert", "longformer", "mpnet"}
Inputs = Sequence[str | Sequence[int]]  # a batch may mix texts and token-id lists
# Vocabulary entries held in reserve (BERT's [unused0]…, T5's <extra_id_0>…): no text gives them.
_RESERVED = re.compile(r"\[unused\d+\]|<unused\d+>|<extra_id_\d+>")


@dataclass
class Batch:
    input_ids: np.ndarray  # int64 [N, L], right-padded
    attention_mask: np.ndarray  # int64 [N, L]
    token_type_ids: np.ndarray  # int64 [N, L], all zeros: single-segment inputs
    lengths: list[int]


def config_max_length(config: Any, tokenizer: Any) -> int:
    """The longest input the network itself takes: its position table, the tokenizer's limit."""
    limits = []
    positions = getattr(config, "max_position_embeddings", None)
    if positions:
        if getattr(config, "model_type", "") in _OFFSET_POSITIONS:
            positions -= (getattr(config, "pad_token_id", None) or 0) + 1
        limits.append(int(positions))
    declared = getattr(tokenizer, "model_max_length", None)
    if declared and declared < _NO_LIMIT:
        limits.append(int(declared))
    return min(limits) if limits else 512


def max_chars_per_token(tokenizer: Any) -> int:
    """An upper bound on the characters one token of a transformers tokenizer spells: its
    longest vocabulary entry plus one (a decoder's joining space), times 4 where a normalizer
    composes Unicode (as `modelyard.engine.tokenizer.Tokenizer.max_chars_per_token`). Text a
    tokenizer would drop (whitespace, accents) still counts."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizer = backend.normalizer if backend is not None else None
    state = normalizer.__getstate__().decode() if normalizer is not None else ""
    composes = any(f'"{kind}"' in state for kind in ("NFC", "NFKC", "Precompiled"))
    return (longest + 1) * (4 if composes else 1)


def reserved_ids(tokenizer: Any) -> dict[int, str]:
    """Ids the tokenizer never gives for text (`encode(text, add_special_tokens=False)`): its
    special tokens but the unknown one, and its reserved entries."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    reserved = {i: t for t, i in vocab.items() if _RESERVED.fullmatch(t)}
    unk = tokenizer.unk_token_id
    for token, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=True):
        if i != unk:
            reserved[int(i)] = str(token)
    return reserved


def _special_frame(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a single text's tokens."""
    probe = "hello"
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return list(full[:start]), list(full[start + len(bare) :])
    return [], []


class InputTokenizer:
    """An `AutoTokenizer` from a local folder, with the model's length limit applied."""

    def __init__(self, folder: Path, max_length: int | None = None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.max_length = max_length or config_max_length(None, self.tokenizer)
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self.vocab_size = len(self.tokenizer)
        self.prefix, self.suffix = _special_frame(self.tokenizer)
        self.chars_per_token = max_chars_per_token(self.tokenizer)
        self.reserved = reserved_ids(self.tokenizer)

    @property
    def max_chars(self) -> int:
        """The most characters an input of `max_length` tokens can spell: a longer text is
        refused before the tokenizer spends time on it."""
        return self.max_length * self.chars_per_token

    def ids(self, inputs: Inputs) -> list[list[int]]:
        """Token ids of each input, special tokens included; long inputs are refused."""
        texts = [i for i, x in enumerate(inputs) if isinstance(x, str)]
        for i in texts:
            if len(inputs[i]) > self.max_chars:
                raise InputTooManyChars(i, len(inputs[i]), self.max_chars, self.max_length)
        out: list[list[int]] = [[] for _ in inputs]
        if texts:
            # truncation/padding off overrides what a tokenizer.json may configure (MiniLM's
            # pads and truncates to 128); verbose off drops the "longer than" warning we handle.
            encoded = self.tokenizer(
                [inputs[i] for i in texts],
                add_special_tokens=True,
                truncation=False,
                padding=False,
                return_attention_mask=False,
                return_token_type_ids=False,
                verbose=False,
            )["input_ids"]
            for i, ids in zip(texts, encoded, strict=True):
                out[i] = list(ids)
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                continue
            for token in x:
                if not 0 <= token < self.vocab_size:
                    raise InvalidTokenId(i, int(token), self.vocab_size)
                if token in self.reserved:  # ids from some other tokenizer, most likely
                    raise ForeignTokenId(i, int(token), self.reserved[token], self.vocab_size)
            out[i] = [*self.prefix, *(int(t) for t in x), *self.suffix]
        for i, ids in enumerate(out):
            if len(ids) > self.max_length:
                raise InputTooLong(i, len(ids), self.max_length)
        return out

    def batch(self, ids: list[list[int]]) -> Batch:
        lengths = [len(x) for x in ids]
        width = max(lengths)
        input_ids = np.full((len(ids), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(ids), width), dtype=np.int64)
        for row, x in enumerate(ids):
            input_ids[row, : len(x)] = x
            mask[row, : len(x)] = 1
        return Batch(input_ids, mask, np.zeros_like(input_ids), lengths)
