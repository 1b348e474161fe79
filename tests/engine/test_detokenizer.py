"""Incremental detokenization: exact text, multi-byte characters, stop strings never leaked."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelyard.engine.detokenizer import IncrementalDetokenizer
from modelyard.engine.models.loader import read_model_config
from modelyard.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.load(tiny_llama, read_model_config(tiny_llama))


def stream(tok: Tokenizer, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], str, bool]:
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"), stop)
    deltas = []
    for t in tok.encode(text, add_special_tokens=False):
        detok.add_token(t)
        deltas.append(detok.take_delta())
        if detok.stopped:
            break
    deltas.append(detok.take_delta(final=True))
    return deltas, detok.text, detok.stopped


def test_deltas_concatenate_to_the_decoded_text(tokenizer: Tokenizer) -> None:
    text = " The quick brown fox, naïve café — 日本語 🚀 done."
    deltas, full, stopped = stream(tokenizer, text)
    assert "".join(deltas) == full == text and not stopped
    assert all("\ufffd" not in d for d in deltas)  # split characters wait for their last byte


def test_stop_string_cuts_the_text_and_is_never_streamed(tokenizer: Tokenizer) -> None:
    deltas, full, stopped = stream(tokenizer, " one two three four", stop=("three",))
    assert stopped and full == " one two "
    assert "".join(deltas) == " one two "
    assert not any("thr" in d for d in deltas)


def test_partial_stop_match_is_held_back_then_released(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], stop=("STOP!",))
    for t in tokenizer.encode("go ST", add_special_tokens=False):
        detok.add_token(t)
    assert detok.take_delta() == "go "  # "ST" could still become "STOP!"
    for t in tokenizer.encode("AY", add_special_tokens=False):
        detok.add_token(t)
    assert detok.take_delta() == "STAY" and not detok.stopped
