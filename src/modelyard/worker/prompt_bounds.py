"""A prompt bounded in characters against the model's context, before any template renders it
or any tokenizer reads it.

No token of the model's tokenizer stands for more than `chars_per_token` characters
(`Tokenizer.max_chars_per_token`), so a text of more than `max_model_len × chars_per_token`
characters needs more tokens than the context holds: it is refused with OpenAI's
`context_length_exceeded` 400 at once, without rendering or tokenizing it. What is counted is
what the client sent: every message's text (a message counts at least one token's worth, its
role marker), the history's tool calls, and the tools' definitions as compact JSON. A
tokenizer or template that would discard text (whitespace-splitting or accent-stripping
tokenizers, a template that trims) is held to the same bound: text it would drop still counts.

After tokenizing (off the event loop) a prompt longer than the context is refused there too,
so the event loop never walks more than `max_model_len` token ids of it.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from modelyard.protocol.errors import APIError, bad_request
from modelyard.protocol.openai import ChatCompletionRequest


class PromptBudget:
    def __init__(self, max_model_len: int, chars_per_token: int) -> None:
        self.max_model_len = max_model_len
        self.chars_per_token = chars_per_token
        self.max_chars = max_model_len * chars_per_token

    def _too_long(self, chars: int, what: str, param: str) -> APIError:
        return bad_request(
            f"This model's maximum context length is {self.max_model_len} tokens, and no "
            f"token of its tokenizer stands for more than {self.chars_per_token} characters, "
            f"so at most {self.max_chars} characters can fit. However, your {what} hold "
            f"{chars} characters or more. Please reduce the length of the {what}.",
            param,
            "context_length_exceeded",
        )

    def check_chat(self, req: ChatCompletionRequest) -> None:
        """Refuse messages and tools that cannot fit, counting as it goes (it stops at the
        bound: the work is bounded by the bound, not by the request)."""
        chars = 0
        for m in req.messages:
            # The role marker counts as a token; the text is content or else refusal.
            chars += self.chars_per_token + len(m.name or "") + len(m.text())
            for call in m.tool_calls or ():
                chars += len(call.function.name) + len(call.function.arguments)
            if m.function_call is not None:
                chars += len(m.function_call.name) + len(m.function_call.arguments)
            if chars > self.max_chars:
                raise self._too_long(chars, "messages", "messages")
        functions = [t.function for t in req.tools or ()] + list(req.functions or ())
        for f in functions:
            chars += len(f.name) + len(f.description or "")
            if f.parameters is not None:
                chars += _json_chars(f.parameters)
            if chars > self.max_chars:
                raise self._too_long(chars, "messages and tools", "tools")

    def check_text(self, text: str, param: str = "prompt") -> None:
        if len(text) > self.max_chars:
            raise self._too_long(len(text), "prompt", param)

    def check_tokens(self, count: int, param: str) -> None:
        """A tokenized prompt longer than the context (checked before the event loop walks
        its ids)."""
        if count > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your {param} resulted in {count} tokens. Please reduce the length "
                f"of the {param}.",
                param,
                "context_length_exceeded",
            )


def _json_chars(value: Any) -> int:
    """At least the characters of `value` as compact JSON (orjson's UTF-8 bytes; json's text
    for what orjson refuses, such as integers beyond 64 bits)."""
    try:
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError:
        return len(json.dumps(value, separators=(",", ":")))
