"""`Tokenizer`: the model's own tokenizer and chat template, behind a small typed surface."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modelyard.engine.models.config import ModelConfig


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self._token_text: dict[int, str] = {}

    @classmethod
    def load(cls, folder: Path, config: ModelConfig) -> Tokenizer:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(folder))
        eos = set(config.eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        return cls(hf, frozenset(eos))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if not self.has_chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return str(
                self.hf.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt
                )
            )
        except Exception as exc:  # jinja raises whatever the template author chose
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The rendered template already holds the special tokens (BOS included) it wants.
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """The text of a single token, for logprobs."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = str(self.hf.decode([token_id]))
        return text
