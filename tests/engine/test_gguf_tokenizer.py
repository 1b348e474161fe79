"""A GGUF's tokenizer splits text as the model's own does: SmolLM2's file names the `smollm`
pre-tokenizer (every digit its own piece), which transformers' rebuild of the vocabulary lacks;
a folder converted before that was applied is fixed on its next load."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer

from modelyard.engine.models.gguf_convert import CONVERSION
from modelyard.engine.models.loader import to_hf_folder

TEXT = "\n  135M and 2026"
# As SmolLM2's own tokenizer and llama.cpp split it (llama.cpp's /tokenize, 2026-12-06).
PIECES = ["\n  ", "1", "3", "5", "M", " and", " ", "2", "0", "2", "6"]


def pieces(folder: Path) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return [tokenizer.decode([i]) for i in tokenizer.encode(TEXT, add_special_tokens=False)]


def test_smollm2_splits_digits_as_the_model_was_trained(smollm2_folder: Path) -> None:
    assert pieces(smollm2_folder) == PIECES
    assert json.loads((smollm2_folder / "source.json").read_text())["conversion"] == CONVERSION


def test_a_folder_converted_before_has_its_tokenizer_fixed(tmp_path: Path) -> None:
    folder = to_hf_folder("smollm2", tmp_path / "cache")
    # As converted before the fix: transformers' byte-level split alone, no `conversion`.
    path = folder / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.pre_tokenizer = tokenizer.pre_tokenizer[1]  # Sequence([Digits, ByteLevel])
    tokenizer.save(str(path))
    source = json.loads((folder / "source.json").read_text())
    (folder / "source.json").write_text(
        json.dumps({k: v for k, v in source.items() if k != "conversion"})
    )
    assert pieces(folder) != PIECES  # the old split ("\n ", " ", "1", ...)

    assert to_hf_folder("smollm2", tmp_path / "cache") == folder
    assert pieces(folder) == PIECES
    assert json.loads((folder / "source.json").read_text())["conversion"] == CONVERSION
