"""A reasoning model behind `modelyard serve`: the worker's `reasoning_content` (whole and as
stream deltas) and its usage's `reasoning_tokens` reach the client through the gateway, and the
usage row bills thinking and answer alike. The tiny Qwen3 of `tests/tiny_reasoning.py` thinks
one word and answers another."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.platform_harness import (
    PlatformProcess,
    deploy,
    platform_running,
    tiny_models_env,
    wait_usage,
)
from tests.tiny_reasoning import build_reasoning_model, rigged_words

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    build_reasoning_model(root / "thinker")
    return root


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Iterator[PlatformProcess]:
    with platform_running(tmp_path_factory.mktemp("data"), tiny_models_env(models)) as p:
        deploy(p.api(), "thinker", str(models / "thinker"))
        yield p


@pytest.fixture(scope="module")
def words(models: Path) -> tuple[str, str]:
    return rigged_words(AutoTokenizer.from_pretrained(str(models / "thinker")))


def test_the_thinking_and_its_tokens_pass_the_gateway(
    platform: PlatformProcess, words: tuple[str, str]
) -> None:
    thought, answer = words
    client = platform.openai()
    whole = client.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=16)
    message = whole.choices[0].message
    assert (message.content, getattr(message, "reasoning_content", None)) == (answer, thought)
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert whole.usage.completion_tokens_details.reasoning_tokens == 3  # <think> word </think>

    stream = client.chat.completions.create(
        model="thinker", messages=MESSAGES, max_tokens=16, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    reasoning, content, usage = "", "", None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (thought, answer)
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens

    # Billed: both calls' rows count the thinking among the completion tokens.
    rows = wait_usage(platform.api(), lambda rows: len(rows) == 2, model="thinker")
    assert [int(r["completion_tokens"]) for r in rows] == [whole.usage.completion_tokens] * 2
