"""What a deployed model says it is (`/v1/models`' kind and capabilities), read from its folder:
an LLM with a chat template is a chat model, one without a completion model (whose chat
requests the gateway refuses naming /v1/completions), encoders keep their kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelyard.config import EngineSettings
from modelyard.control.model_card import describe
from modelyard.core.model_kinds import ModelKind, WrongModelKind, refuse_wrong_kind

LLAMA = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 2048}


def folder(root: Path, config: dict, **files: object) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    for name, content in files.items():
        (root / name.replace("__", ".")).write_text(json.dumps(content))
    return root


def test_an_llm_with_a_chat_template_is_a_chat_model(tmp_path: Path) -> None:
    template = {"chat_template": "{% for m in messages %}<think>{{ m.content }}{% endfor %}"}
    path = folder(tmp_path / "m", LLAMA, tokenizer_config__json=template)
    kind, caps = describe(path, "llm", EngineSettings(max_loras=2))
    assert kind is ModelKind.CHAT
    assert caps == {
        "tools": True,
        "structured_outputs": True,
        "reasoning": True,
        "adapters": True,
        "max_context": 2048,
    }
    # The engine's own limit, when set, is the context.
    assert describe(path, "llm", EngineSettings(max_model_len=512))[1]["max_context"] == 512


def test_an_llm_without_one_is_a_completion_model(tmp_path: Path) -> None:
    path = folder(tmp_path / "base", LLAMA, tokenizer_config__json={"eos_token": "</s>"})
    kind, caps = describe(path, "llm", EngineSettings())
    assert kind is ModelKind.COMPLETION and caps["tools"] is False
    with pytest.raises(WrongModelKind) as caught:
        refuse_wrong_kind("base", kind, "chat.completions")
    assert caught.value.code == "wrong_model_kind" and caught.value.kind == "invalid"
    assert "completion model" in caught.value.message
    assert "/v1/completions" in caught.value.message
    refuse_wrong_kind("base", kind, "completions")  # its own route
    refuse_wrong_kind("base", None, "embeddings")  # not known yet (provisioning): let through


def test_encoders_keep_their_kind_and_input_limit(tmp_path: Path) -> None:
    bert = {"architectures": ["BertModel"], "max_position_embeddings": 512}
    path = folder(tmp_path / "e", bert, sentence_bert_config__json={"max_seq_length": 256})
    assert describe(path, "embedding", EngineSettings()) == (
        ModelKind.EMBEDDING,
        {"max_context": 256},
    )
    assert describe(path, "onnx-classifier", EngineSettings())[0] is ModelKind.CLASSIFIER
