"""Reasoning models: the thinking a model writes between `<think>` and `</think>` (Qwen3,
DeepSeek-R1 distills) goes out as `reasoning_content`, the rest as the answer (`content`, tool
calls, structured output).

A model reasons when its chat template mentions `<think>` and its tokenizer has `<think>` and
`</think>` as tokens of their own (`reasoning_format`). Where its output starts is read from the
rendered prompt (`ThinkMode`): a prompt ending in `<think>` opened the thinking (DeepSeek-R1
distills, Qwen3's thinking-only models), one ending in `</think>` closed it (Qwen3 with
`enable_thinking: false`), any other leaves it to the model, which thinks when its output
starts with `<think>` (Qwen3). A model that never writes `</think>` (cut by `max_tokens`) gave
only thinking. The whitespace around the thinking, and before the answer, is not part of
either (the templates put it back when the turn is sent again).

`ReasoningSplitter` splits a stream as its text comes, holding back only what may be the start
of a tag (or whitespace that may end the thinking); the unstreamed split is the same splitter
fed the whole text, so both give the same characters. `ReasoningTokens` counts each choice's
thinking tokens (usage's `reasoning_tokens`) by token id, and `Thinking.gate` tells the engine
where a constraint (structured output, a forced tool call) starts: after the thinking.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from modelyard.engine.client import ThinkingGate

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkMode(enum.Enum):
    INSIDE = "inside"  # the prompt opened the thinking
    MAY = "may"  # the model opens it, if at all, with its first token
    OFF = "off"  # the prompt closed it: everything is the answer


class _Tokens(Protocol):
    chat_template: str | None

    def token_id(self, token: str) -> int | None: ...


@dataclass(frozen=True)
class ReasoningFormat:
    start_id: int
    end_id: int

    def mode(self, prompt: str) -> ThinkMode:
        """Where the output of this rendered prompt starts."""
        tail = prompt.rstrip()
        if tail.endswith(THINK_START):
            return ThinkMode.INSIDE
        if tail.endswith(THINK_END):
            return ThinkMode.OFF
        return ThinkMode.MAY


def reasoning_format(tokenizer: _Tokens) -> ReasoningFormat | None:
    """The model's thinking tags, if it reasons (see the module's docstring)."""
    if THINK_START not in str(tokenizer.chat_template or ""):
        return None
    start, end = tokenizer.token_id(THINK_START), tokenizer.token_id(THINK_END)
    return None if start is None or end is None else ReasoningFormat(start, end)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _State(enum.Enum):
    OPENING = "opening"  # MAY: not yet known whether the output starts with `<think>`
    THINKING = "thinking"
    ANSWER = "answer"


class ReasoningSplitter:
    """One choice's text, as it comes, split into thinking and answer."""

    def __init__(self, mode: ThinkMode) -> None:
        self.state = {ThinkMode.INSIDE: _State.THINKING, ThinkMode.MAY: _State.OPENING}.get(
            mode, _State.ANSWER
        )
        self.held = ""  # text not given out yet
        self.thought = False  # some thinking was given out
        self.trim = False  # the answer's leading whitespace is dropped (it follows a thinking)

    def feed(self, delta: str) -> tuple[str, str]:
        """The thinking and the answer that can go out now."""
        text = self.held + delta
        self.held = ""
        if self.state is _State.OPENING:
            if len(text) < len(THINK_START) and THINK_START.startswith(text):
                self.held = text
                return "", ""
            if not text.startswith(THINK_START):
                self.state = _State.ANSWER
                return "", text
            self.state, text = _State.THINKING, text[len(THINK_START) :]
        if self.state is _State.THINKING:
            thinking, end, rest = text.partition(THINK_END)
            if not end:
                keep = len(text) - _partial_tag(text, THINK_END)
                thinking = text[:keep].rstrip()
                self.held = text[len(thinking) :]
            thinking = thinking if self.thought else thinking.lstrip()
            self.thought = self.thought or bool(thinking)
            if not end:
                return thinking, ""
            self.state, self.trim = _State.ANSWER, True
            return thinking.rstrip(), self._answer(rest)
        return "", self._answer(text)

    def _answer(self, text: str) -> str:
        if self.trim:
            text = text.lstrip()
            self.trim = not text
        return text

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        held, self.held = self.held, ""
        if self.state is _State.THINKING:
            return (held.rstrip() if self.thought else held.strip()), ""
        return "", held


def split_reasoning(text: str, mode: ThinkMode) -> tuple[str | None, str]:
    """A whole output's thinking (None: none) and answer."""
    splitter = ReasoningSplitter(mode)
    thinking, answer = splitter.feed(text)
    more_thinking, more_answer = splitter.finish()
    return (thinking + more_thinking) or None, answer + more_answer


@dataclass
class _Count:
    thinking: bool | None  # None: not known yet (MAY, before the first token)
    tokens: int = 0


@dataclass
class ReasoningTokens:
    """The thinking tokens (`</think>` included) of every choice of a request."""

    fmt: ReasoningFormat
    mode: ThinkMode
    counts: dict[tuple[int, int], _Count] = field(default_factory=dict)

    def add(self, choice: tuple[int, int], token_ids: list[int]) -> None:
        initial = {ThinkMode.INSIDE: True, ThinkMode.OFF: False}.get(self.mode)
        count = self.counts.setdefault(choice, _Count(initial))
        for token in token_ids:
            if count.thinking is None:
                count.thinking = token == self.fmt.start_id
            if not count.thinking:
                return
            count.tokens += 1
            count.thinking = token != self.fmt.end_id

    @property
    def total(self) -> int:
        return sum(c.tokens for c in self.counts.values())


@dataclass(frozen=True)
class Thinking:
    """How one chat request's output splits: the model's tags, where its output starts."""

    fmt: ReasoningFormat
    mode: ThinkMode

    @classmethod
    def of(cls, fmt: ReasoningFormat | None, prompt: str) -> Thinking | None:
        return None if fmt is None else cls(fmt, fmt.mode(prompt))

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.mode)

    def split(self, text: str) -> tuple[str | None, str]:
        return split_reasoning(text, self.mode)

    def tokens(self) -> ReasoningTokens:
        return ReasoningTokens(self.fmt, self.mode)

    @property
    def gate(self) -> ThinkingGate | None:
        """Where the engine starts a constraint: after the thinking (None: from the start)."""
        if self.mode is ThinkMode.OFF:
            return None
        start = self.fmt.start_id if self.mode is ThinkMode.MAY else None
        return ThinkingGate(self.fmt.end_id, start)
