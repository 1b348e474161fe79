"""A tiny Qwen3 that reasons: the tiny tokenizer with `<think>`/`</think>` as tokens of their own
(not special, as in Qwen3's), Qwen3's real chat template, and weights rigged so that greedy
decoding writes a known thinking and answer.

The rig: every layer's output projections are zero, so the residual stream stays the current
token's embedding and the net is a bigram table. The chain's tokens get orthogonal embeddings and
`lm_head` maps each onto the next: after the generation prompt's last token ("\\n") the model
writes `<think>`, a word, `</think>`, another word, `<|im_end|>` (its end of sequence): the
words are `rigged_words`, two single tokens of the tiny vocabulary.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import torch

# Qwen3's chat template (Qwen/Qwen3-8B's tokenizer_config.json), as published.
QWEN3_CHAT_TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text()


def _one_token(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return int(ids[0])


def rigged_words(tokenizer: Any) -> tuple[str, str]:
    """What the rigged model thinks and what it answers: the vocabulary's first two tokens that
    are lowercase words of three letters or more."""
    words = [
        text
        for i in range(len(tokenizer))
        if re.fullmatch("[a-z]{3,}", text := tokenizer.decode([i]))
        and tokenizer.encode(text, add_special_tokens=False) == [i]
    ]
    return words[0], words[1]


def build_reasoning_model(folder: Path) -> Path:
    """Save the rigged tiny Qwen3 (see the module's docstring) into `folder`."""
    import transformers

    from tests.tiny_models import build_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_tokens(["<think>", "</think>"])  # not special: they stay in decoded text
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    prompt_end = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)[-1]
    chain = [
        prompt_end,
        _one_token(tokenizer, "<think>"),
        _one_token(tokenizer, rigged_words(tokenizer)[0]),
        _one_token(tokenizer, "</think>"),
        _one_token(tokenizer, rigged_words(tokenizer)[1]),
        int(tokenizer.eos_token_id),
    ]
    hidden = 64
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # the layers add nothing: the net is a bigram table
        embed = model.model.embed_tokens.weight
        basis, _ = torch.linalg.qr(torch.randn(hidden, hidden))
        for i, token in enumerate(chain):
            embed[token] = basis[i] * hidden**0.5
        model.lm_head.weight.zero_()
        for token, following in itertools.pairwise(chain):
            model.lm_head.weight[following] += embed[token] * 0.5
    model.save_pretrained(str(folder))
    return folder
