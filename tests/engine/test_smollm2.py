"""SmolLM2-135M-Instruct from its GGUF file: our loader (dequantize, un-permute Q/K) and engine
against transformers' own GGUF loader and Llama implementation — logits and greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from modelyard.engine.models.bundled import resolve_model_path
from tests.parity import hf_greedy, hf_logits, make_engine, record_logits, run_staggered

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves falling in a quiet forest at dusk.",
    "hi",
    "Explain quantum computing in simple terms for a ten year old child who likes games.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish and German, and explain where each is used.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes with exactly five ingredients and short steps.",
]


@pytest.fixture(scope="module")
def hf_smollm2() -> Any:
    from transformers import AutoModelForCausalLM

    gguf = resolve_model_path("smollm2")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def engine(smollm2_folder: Path) -> Any:
    return make_engine(smollm2_folder, block_size=16, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def chat_prompts(engine: Any) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def test_chat_template_and_tokenizer_come_from_the_gguf(engine: Any) -> None:
    tok = engine.tokenizer
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    assert tok.token_id("<|im_end|>") in tok.eos_token_ids


def test_logits_match_transformers(engine: Any, hf_smollm2: Any, chat_prompts: list) -> None:
    with record_logits(engine) as records:
        run_staggered(engine, chat_prompts[:3], max_tokens=4)
    assert len(records) == 12
    worst = 0.0
    for tokens, logits in records:
        ref = hf_logits(hf_smollm2, tokens)
        worst = max(worst, float((logits - ref).abs().max()))
        assert int(logits.argmax()) == int(ref.argmax())
    print(f"max |logits - transformers| = {worst:.2e}")
    assert worst < 2e-3, worst


@pytest.mark.timeout(360)  # SmolLM2 alone and batched: 150 s on a busy 2 vCPU
def test_greedy_32_tokens_identical_alone_and_batched(
    engine: Any, hf_smollm2: Any, chat_prompts: list
) -> None:
    expected = {i: hf_greedy(hf_smollm2, p, 32) for i, p in enumerate(chat_prompts)}
    assert run_staggered(engine, chat_prompts[:1], 32) == {0: expected[0]}
    assert run_staggered(engine, chat_prompts, 32, join_every=3) == expected
    assert engine.kv.pool.num_free == engine.kv.num_blocks
