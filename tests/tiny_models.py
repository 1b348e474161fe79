"""Tiny random-weight models built on the fly: a byte-level BPE tokenizer and Llama-family nets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Quantum computing is a type of computation that uses qubits.",
    "Machine learning models can be trained on large datasets.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Paged attention stores keys and values in fixed-size blocks.",
] * 20


def build_tokenizer(folder: Path, vocab_size: int = 384) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def build_model(
    folder: Path,
    model_type: str = "llama",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Save a random-weight model of `model_type` (with tokenizer) into `folder`."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
    }[model_type]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).to(dtype).eval()
    with torch.no_grad():
        # Random init gives near-uniform logits; sharpen them so greedy choices are clear-cut.
        for name, p in model.named_parameters():
            if name.endswith("proj.weight") or "embed" in name or "lm_head" in name:
                p.normal_(0.0, 0.08)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.08)  # the experts as transformers holds them, stacked
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.5)  # routers: clear-cut expert choices, not near-ties
    model.save_pretrained(str(folder))
    return folder
