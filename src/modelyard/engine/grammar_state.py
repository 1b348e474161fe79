"""One sequence's grammar matcher as it follows the sequence's output (`GrammarState`), and what
its mask needs besides (`Closers`). The matcher comes from `modelyard.engine.grammar`; the mask
is built by `modelyard.engine.grammar_mask`.

A reasoning model's constraint applies to its answer, not its thinking (`ThinkingGate`): the
matcher sees no token until the one that ends the thinking (`</think>`), and the steps before
it are not masked. A model that may open its thinking itself (Qwen3's template leaves that to
the model) gets the grammar from its first token unless that token opens the thinking: the first
step's mask is the grammar's plus the opening token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from modelyard.engine.structured import ThinkingGate

MAX_ERROR_CHARS = 400


class GrammarViolation(RuntimeError):
    """A sequence's matcher refused a token or broke (fails that request only)."""


def short_error(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 1] + "…"


@dataclass(frozen=True)
class Closers:
    """`[vocab]` booleans: tokens that end a string (`"`, `"}`…) and tokens of `}`/`]` only."""

    quote: torch.Tensor
    brace: torch.Tensor


class GrammarState:
    """One sequence's matcher. It has consumed exactly the sequence's answer tokens (all its
    output tokens, or those after its thinking): a preempted sequence keeps its tokens (it is
    recomputed, not resampled), and `sync` rebuilds the state from the tokens should the two
    ever differ."""

    def __init__(
        self,
        matcher: Any,
        words: int,
        closers: Closers,
        closing_from: int,
        gate: ThinkingGate | None = None,
    ) -> None:
        self.matcher = matcher
        self.words = words
        self.closers = closers  # see `modelyard.engine.grammar`'s docstring
        self.closing_from = closing_from
        self.gate = gate
        self.consumed = 0  # answer tokens the matcher consumed
        self.seen = 0  # output tokens seen, thinking included
        self.start: int | None = None  # where the answer starts in the output, once known
        self._restart()

    def _restart(self) -> None:
        self.matcher.reset()
        self.consumed = self.seen = 0
        self.start = 0 if self.gate is None else None

    @property
    def opener(self) -> int | None:
        """The token that may open the thinking at this step, besides the grammar's tokens."""
        gate = self.gate
        undecided = gate is not None and self.start is None and self.seen == 0
        return gate.start if undecided and gate is not None else None

    @property
    def masks(self) -> bool:
        """Whether this step is constrained (not inside the thinking)."""
        return self.start is not None or self.opener is not None

    @property
    def closing(self) -> bool:
        """In the last tokens of its budget: prefer the tokens that close what is open."""
        return self.seen >= self.closing_from

    @property
    def complete(self) -> bool:
        """Nothing more can follow: the output is a full sentence of the grammar (a broken
        matcher is stopped too: `GrammarViolation`, never an empty "complete" output)."""
        self.check()
        return self.start is not None and bool(self.matcher.is_stopped())

    def check(self) -> None:
        if self.matcher.is_error():
            raise GrammarViolation(short_error(self.matcher.get_error()))

    def sync(self, output_token_ids: list[int]) -> None:
        answer = None if self.start is None else self.seen - self.start
        if self.seen == len(output_token_ids) and answer in (None, self.consumed):
            return
        self._restart()
        for token in output_token_ids:
            self._take(token)

    def _take(self, token: int) -> None:
        self.seen += 1
        gate = self.gate
        if self.start is None and gate is not None:
            if self.seen == 1 and gate.start is not None and token != gate.start:
                self.start = 0  # the model answered without thinking
            else:
                if token == gate.end:
                    self.start = self.seen
                return
        if not self.matcher.consume_token(token):
            raise GrammarViolation(short_error(self.matcher.get_error()))
        self.consumed += 1

    def advance(self, token: int) -> bool:
        """Take the sampled token; True when the grammar is complete."""
        self._take(token)
        return self.complete
