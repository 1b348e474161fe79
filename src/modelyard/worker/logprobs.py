"""Logprobs in the two OpenAI shapes: chat (`content` entries with bytes) and text completions
(parallel lists with text offsets). Token texts come from the tokenizer's cache."""

from __future__ import annotations

from typing import Any

from modelyard.engine.client import Tokenizer, TokenLogprob


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
    }


def completion_logprobs(
    tokenizer: Tokenizer, logprobs: list[TokenLogprob], offset: int = 0
) -> dict[str, Any]:
    tokens = [tokenizer.token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{tokenizer.token_text(t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }
