"""What a request asks its output to conform to: the data the engine's grammar masks are built from.

`StructuredOutput(kind, spec)` is plain, hashable data (it keys the compile cache): a JSON
schema as JSON text, a regular expression, a JSON list of choices, or an EBNF (GBNF/Lark-style)
grammar. The worker builds it from `response_format` / `guided_*` (or from a tool choice) and
compiles it before the request is queued (`modelyard.engine.grammar`); `compiled` carries that
request's own matcher (`RequestGrammar`) into the engine so that nothing is compiled on the
engine's thread, and `gate` (a reasoning model's) where in the output the constraint starts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class StructuredKind(enum.StrEnum):
    JSON_OBJECT = "json_object"  # any JSON object; spec is ""
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    REGEX = "regex"  # spec: the regular expression the whole output must match
    CHOICE = "choice"  # spec: a JSON list of the strings the output may be
    GRAMMAR = "grammar"  # spec: an EBNF grammar (Lark syntax, or GBNF with `root ::=`)


@dataclass(frozen=True)
class ThinkingGate:
    """A reasoning model's constraint applies after its thinking: from the token after `end`
    (`</think>`). `start` None: the output starts inside the thinking (the prompt opened it);
    else the token that opens it, which the model may emit first (the constraint applies from
    the first token when it does not)."""

    end: int
    start: int | None = None


@dataclass(frozen=True)
class StructuredOutput:
    kind: StructuredKind
    spec: str = ""
    # The request's matcher (engine.grammar.RequestGrammar) once the worker prepared it; not part
    # of the identity, so two requests with the same (kind, spec) compare and hash equal.
    compiled: Any = field(default=None, compare=False, hash=False, repr=False)
    gate: ThinkingGate | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept the kind's value ("json_schema") as well as the enum member.
        object.__setattr__(self, "kind", StructuredKind(self.kind))

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind.value, self.spec)
