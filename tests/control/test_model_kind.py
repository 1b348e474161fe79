"""What a deployed folder is, read from its `config.json`: an LLM for the engine, an encoder for
the encoder host, or (refused at deploy, naming what it found) neither."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelyard.control.model_kind import LLM, UnknownArchitecture, detect
from tests.platform_harness import PlatformProcess


def config_folder(root: Path, name: str, config: dict) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("config", "kind"),
    [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, LLM),
        ({"model_type": "qwen2"}, LLM),  # no architectures: the engine's model type decides
        ({"architectures": ["BertModel"], "model_type": "bert"}, "embedding"),
        ({"architectures": ["BertForMaskedLM"], "model_type": "bert"}, "embedding"),
        ({"architectures": ["BertForSequenceClassification"]}, "classifier"),
        ({"model_type": "bert"}, "embedding"),  # names nothing: read as an embedding model
    ],
)
def test_known_architectures_are_told_apart(tmp_path: Path, config: dict, kind: str) -> None:
    assert detect(config_folder(tmp_path, "m", config)) == kind


def test_an_unknown_architecture_is_refused_naming_it(tmp_path: Path) -> None:
    config = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"}
    with pytest.raises(UnknownArchitecture) as caught:
        detect(config_folder(tmp_path, "t5", config))
    assert caught.value.kind == "invalid" and caught.value.code == "unsupported_architecture"
    assert "T5ForConditionalGeneration" in caught.value.message


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlatformProcess]:
    p = PlatformProcess(tmp_path_factory.mktemp("data")).start()
    try:
        yield p
    finally:
        p.stop()


def test_deploying_an_unknown_architecture_is_a_400(
    platform: PlatformProcess, tmp_path: Path
) -> None:
    """It used to deploy as an embedding model and report ready."""
    config = {"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper"}
    folder = config_folder(tmp_path, "whisper", config)
    admin = platform.api()
    r = admin.post("/v1/models/deploy", json={"model_name": "w", "model_artifact": str(folder)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_architecture" and error["param"] == "model_artifact"
    assert "WhisperForConditionalGeneration" in error["message"]
    assert admin.get("/v1/endpoints").json()["data"] == []
