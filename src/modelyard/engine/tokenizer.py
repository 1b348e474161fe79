"""`Tokenizer`: the model's own tokenizer and chat template, behind a small typed surface.

A model folder with `tokenizer.json` is served by the `tokenizers` library directly and its chat
template is rendered with jinja2 the way transformers renders it (sandboxed, `trim_blocks`,
`lstrip_blocks`, `tojson`, `raise_exception`, the special tokens in the context): this skips
importing transformers, over a second of every cold start. Folders with only slow-tokenizer
files fall back to transformers' `AutoTokenizer`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from modelyard.engine.models.config import ModelConfig

_CLEAN_UP = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
    (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
# Normalizers that compose Unicode (SentencePiece's precompiled charsmap is NFKC-based).
_COMPOSING = ("NFC", "NFKC", "Precompiled")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization_spaces`, for configs that ask for it."""
    for a, b in _CLEAN_UP:
        text = text.replace(a, b)
    return text


def _template_environment() -> Any:
    from jinja2 import TemplateError, nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}…{% endgeneration %}` (marks assistant text for training): the
        body renders as is."""

        tags = {"generation"}  # noqa: RUF012  # jinja2 declares it an instance variable

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class Tokenizer:
    def __init__(
        self,
        backend: Any,
        eos_token_ids: frozenset[int],
        chat_template: str | None,
        special_tokens: dict[str, str],
        clean_up_spaces: bool = False,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.clean_up_spaces = clean_up_spaces
        self._template: Any = None
        self._token_text: dict[int, str] = {}

    @classmethod
    def load(cls, folder: Path, config: ModelConfig) -> Tokenizer:
        settings: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").exists():
            settings = json.loads((folder / "tokenizer_config.json").read_text())
        if not (folder / "tokenizer.json").exists():
            return cls._from_transformers(folder, config)
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_file(str(folder / "tokenizer.json"))
        template = settings.get("chat_template")
        if isinstance(template, list):  # named templates: the default one serves chat
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        special = {k: v for k in _SPECIAL_KEYS if (v := _token_str(settings.get(k))) is not None}
        eos = set(config.eos_token_ids)
        if (
            "eos_token" in special
            and (eos_id := backend.token_to_id(special["eos_token"])) is not None
        ):
            eos.add(eos_id)
        clean = bool(settings.get("clean_up_tokenization_spaces", False))
        return cls(backend, frozenset(eos), template, special, clean)

    @classmethod
    def _from_transformers(cls, folder: Path, config: ModelConfig) -> Tokenizer:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(folder))
        backend = hf.backend_tokenizer if hasattr(hf, "backend_tokenizer") else None
        if backend is None:
            raise ValueError(f"{folder}: only fast (tokenizers) tokenizers are supported")
        special = {k: v for k in _SPECIAL_KEYS if isinstance(v := getattr(hf, k, None), str)}
        eos = set(config.eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        clean = bool(getattr(hf, "clean_up_tokenization_spaces", False))
        return cls(backend, frozenset(eos), hf.chat_template, special, clean)

    # ----- tokens ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def pad_token_id(self) -> int | None:
        token = self.special_tokens.get("pad_token") or self.special_tokens.get("eos_token")
        return None if token is None else self.token_id(token)

    def token_id(self, token: str) -> int | None:
        found: int | None = self.backend.token_to_id(token)
        return found

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, with the GIL released while the tokenizer runs (its
        `encode_batch` releases it, `encode` does not): for a thread off an event loop."""
        encodings = self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    def max_chars_per_token(self) -> int:
        """An upper bound on the characters of text one token stands for: the longest entry of
        the vocabulary (byte-level entries spell a byte per character, SentencePiece's `▁` one
        space, byte-fallback `<0x41>` one byte, WordPiece's `##` nothing), plus one for a
        decoder that joins words with a space, times 4 where a normalizer composes Unicode
        (NFC/NFKC join at most 4 code points into one: Unicode's longest canonical
        decompositions, such as U+1F82, are 4 long)."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        longest = max((len(token) for token in vocab), default=1)
        normalizer = self.backend.normalizer
        state = normalizer.__getstate__().decode() if normalizer is not None else ""
        composes = any(f'"{kind}"' in state for kind in _COMPOSING)
        return (longest + 1) * (4 if composes else 1)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text = str(self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens))
        return _clean_up_tokenization(text) if self.clean_up_spaces else text

    def token_text(self, token_id: int) -> str:
        """The text of a single token, for logprobs."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    # ----- chat ------------------------------------------------------------------------------

    @property
    def template_supports_tools(self) -> bool:
        """Whether the chat template renders tool definitions itself (it reads `tools`, as
        Hermes, Qwen, Llama 3.1+ and Mistral templates do); SmolLM2's does not."""
        return bool(self.chat_template) and "tools" in str(self.chat_template)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text; `tools` (OpenAI-shape function tools) go to the template as
        transformers passes them, for templates that render them; `variables` are the
        request's own (`enable_thinking`…), never in place of these."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            if self._template is None:
                self._template = _template_environment().from_string(self.chat_template)
            own = {
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "tools": tools or None,
                "documents": None,
                **self.special_tokens,
            }
            return str(self._template.render({**(variables or {}), **own}))
        except Exception as exc:  # jinja raises whatever the template author chose
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        # The rendered template already holds the special tokens (BOS included) it wants.
        return self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)
