"""Our tokenizer (the `tokenizers` library + jinja2 chat templates, no transformers) gives
exactly what transformers' AutoTokenizer gives: ids, text and rendered chats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from modelyard.engine.models.loader import read_model_config
from modelyard.engine.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "naïve café — 日本語 🚀",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Count to 3"},
        {"role": "assistant", "content": "1, 2, 3"},
        {"role": "user", "content": "Again"},
    ],
]


@pytest.fixture(params=["tiny", "smollm2"])
def pair(request: pytest.FixtureRequest, tiny_llama: Path) -> tuple[Tokenizer, Any]:
    folder = tiny_llama
    if request.param == "smollm2":
        folder = request.getfixturevalue("smollm2_folder")
    ours = Tokenizer.load(folder, read_model_config(folder))
    return ours, AutoTokenizer.from_pretrained(str(folder))


def test_ids_and_text_match_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                )
    assert ours.eos_token_ids >= {hf.eos_token_id}
    assert ours.pad_token_id == (
        hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
    )


def test_chat_templates_render_like_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    for chat in CHATS:
        for generation_prompt in (True, False):
            expected = hf.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=generation_prompt
            )
            assert ours.render_chat(chat, generation_prompt) == expected


def test_template_errors_are_reported(tiny_llama: Path) -> None:
    tok = Tokenizer.load(tiny_llama, read_model_config(tiny_llama))
    tok.chat_template = "{{ raise_exception('only user messages') }}"
    with pytest.raises(ChatTemplateError, match="only user messages"):
        tok.render_chat(CHATS[0])
