"""`IncrementalDetokenizer`: turns a growing list of token ids into text deltas, and stop strings.

Text is only released once it is stable: a token that ends inside a multi-byte character
waits for the next one, and the tail of the text that could still become a stop string is
held back, so a stream never shows part of a stop string.
"""

from __future__ import annotations

from modelyard.engine.tokenizer import Tokenizer

# Prompt tokens kept as context so the first output token decodes as it would mid-text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # the output text so far (cut at a stop string once one matched)
        self._emitted = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string matched

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> None:
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._append_text(new_text)

    def _append_text(self, new_text: str) -> None:
        if self.stopped:
            return
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += new_text
        if not self.stop:
            return
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is the start of a stop string."""
        if self.stopped or not self.stop:
            return 0
        longest = min(max(len(s) for s in self.stop) - 1, len(self.text) - self._emitted)
        for n in range(longest, 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def flush(self) -> None:
        """At the end, release tokens still waiting to complete a character."""
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            self._read_offset = len(self._ids)
            self._append_text(full[len(prefix) :])

    def take_delta(self, final: bool = False) -> str:
        """New text that is safe to show; with `final`, everything left."""
        if final:
            self.flush()
        end = len(self.text) if final else len(self.text) - self._held_back()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta
