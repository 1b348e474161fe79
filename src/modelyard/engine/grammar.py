"""Grammars for constrained decoding: compile a `StructuredOutput` once, one matcher per sequence.

The grammar library is llguidance (chosen by measurement, see BENCHMARKS.md: it compiles a JSON
schema in about a millisecond where xgrammar takes 5-40, masks a batch of 32 in under a
millisecond on this CPU, and needs no extra runtime packages). `GrammarCompiler` builds the
library's tokenizer view lazily (a third of a second, on the first structured request, not at
start), checks each (kind, spec) once into a `CompiledGrammar` (the grammar's text, known to
build) and keeps the last `capacity` of them (LRU). Only that text is shared: every request gets
a fresh matcher of its own (`CompiledGrammar.instance`, about a millisecond), since llguidance's
copies of one matcher share its lexer, and a lexer that broke for one request (a hostile regex
exhausting it) would break, or "complete" empty, every later request with the same grammar.
Each sequence of the request gets a copy of that matcher (`GrammarState`), which follows its
output tokens; its mask is built by `modelyard.engine.grammar_mask`.

Cost is bounded (`LIMITS`, llguidance's fuel and size limits, a fifth to a twentieth of its
defaults; every schema, regex and grammar of the test suite and benchmark fits with room): a
matcher is built and its first mask computed ("probed") where it is compiled, off the engine's
thread (the worker compiles in a thread of its own with a large stack: a grammar's rule chain
is compiled recursively). A grammar that breaks there is the request's 400; one that breaks in a
later step fails in one step bounded by the per-step fuel.

JSON is generated compact-but-readable (`", "` and `": "` separators, no free whitespace): a
small model given free whitespace can emit newlines until `max_tokens` and never close the
object. For the same reason numbers the schema leaves unbounded are bounded
(`bound_numbers`): integers to ±(2^53-1), I-JSON's interoperable range, numbers to that range
and at most 9 decimals; a schema's own bounds and `multipleOf` win. Strings held to a `pattern`
or to an open-ended `format` (email, hostname, uri…) with no `maxLength` get
`maxLength: DEFAULT_MAX_PATTERN_CHARS` (`bound_strings`): such a string may be unable to end
where the model is (an email after `a@b` needs its domain's dot), so nothing could cut it short;
a schema whose pattern needs more than the bound is compiled as given. The output still
validates against the schema as given. And in the last `closing_window(max_tokens)` tokens of
its budget a JSON sequence closes what is open (`GrammarState.closing`,
`grammar_mask.prefer_closers`): inside a free string (most of the vocabulary allowed) it takes
a token that ends the string (`"`, `"}`, `"]`…) where one is allowed; elsewhere one made of `}`
and `]` only. So a string that rambles on is cut short instead of the answer being cut off
mid-JSON. Where no such token is allowed (a
required key, a number's first digit, a pattern not yet met) the model chooses as before.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from modelyard.engine.grammar_state import Closers as Closers
from modelyard.engine.grammar_state import GrammarState as GrammarState
from modelyard.engine.grammar_state import GrammarViolation as GrammarViolation
from modelyard.engine.grammar_state import short_error as _short
from modelyard.engine.structured import StructuredKind, StructuredOutput, ThinkingGate

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from modelyard.engine.tokenizer import Tokenizer

DEFAULT_CACHE_CAPACITY = 256
# llguidance's ParserLimits (defaults: 1M, 200k, 250k states, 500k symbols): a hostile regex such
# as `(x{1000}){1000}` took 1.2-4.6 s of its first mask under the defaults, ~0.1 s under these.
INITIAL_LEXER_FUEL = 50_000
STEP_LEXER_FUEL = 50_000
MAX_LEXER_STATES = 50_000  # 1-2 kB each
MAX_GRAMMAR_SIZE = 100_000
JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}
ANY_OBJECT_SCHEMA = '{"type": "object"}'
SAFE_INTEGER = 2**53 - 1
NUMBER_STEP = 1e-9
CLOSING_WINDOW = 32
CLOSER_CHARS = frozenset('"}]')
DEFAULT_MAX_PATTERN_CHARS = 64
# Formats whose strings have a length of their own (no bound added).
_BOUNDED_FORMATS = frozenset({"date", "time", "date-time", "uuid", "ipv4", "ipv6"})


def closing_window(max_tokens: int) -> int:
    """How many of its last tokens a constrained sequence spends closing what is open."""
    return min(CLOSING_WINDOW, max_tokens // 2)


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled (the request's fault: a 400)."""


def bound_numbers(schema: Any) -> Any:
    """A copy of `schema` in which every integer or number without a bound gets one (see the
    module docstring), so that no digit run can go on forever."""
    if isinstance(schema, list):
        return [bound_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bound_numbers(value) for key, value in schema.items()}
    types = out.get("type")  # a schema's type, or a property named "type" (then not a str)
    kinds = {t for t in (types if isinstance(types, list) else [types]) if isinstance(t, str)}
    if kinds & {"integer", "number"} and "enum" not in out and "const" not in out:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
        if "number" in kinds and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    return out


def bound_strings(schema: Any) -> Any:
    """A copy of `schema` in which every string with a `pattern` or an open-ended `format` and
    no `maxLength` gets `DEFAULT_MAX_PATTERN_CHARS` (see the module docstring)."""
    if isinstance(schema, list):
        return [bound_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bound_strings(value) for key, value in schema.items()}
    if not isinstance(out.get("pattern", out.get("format")), str) or "maxLength" in out:
        return out  # (a property named "pattern" or "format" is a schema, not a str)
    open_format = isinstance(out.get("format"), str) and out["format"] not in _BOUNDED_FORMATS
    if isinstance(out.get("pattern"), str) or open_format:
        out["maxLength"] = DEFAULT_MAX_PATTERN_CHARS
    return out


def _schema_grammar(spec: str, strings_bounded: bool = True) -> str:
    import llguidance

    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the schema is not valid JSON: {exc}") from None
    bounded = bound_numbers(schema)
    schema_text = json.dumps(bound_strings(bounded) if strings_bounded else bounded)
    return llguidance.LLMatcher.grammar_from_json_schema(schema_text, defaults=JSON_OPTIONS)


def grammar_text(structured: StructuredOutput, strings_bounded: bool = True) -> str:
    """The llguidance grammar for `structured`; `GrammarError` when it cannot be written."""
    import llguidance

    matcher = llguidance.LLMatcher
    try:
        if structured.kind is StructuredKind.JSON_OBJECT:
            return matcher.grammar_from_json_schema(ANY_OBJECT_SCHEMA, defaults=JSON_OPTIONS)
        if structured.kind is StructuredKind.JSON_SCHEMA:
            return _schema_grammar(structured.spec, strings_bounded)
        if structured.kind is StructuredKind.REGEX:
            return matcher.grammar_from_regex(structured.spec)
        if structured.kind is StructuredKind.CHOICE:
            choices = json.loads(structured.spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise GrammarError("choices must be non-empty strings")
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        # EBNF: Lark syntax, or GBNF (`root ::= …`, llama.cpp's), converted to Lark.
        return llguidance.grammar_from("grammar", structured.spec)
    except GrammarError:
        raise
    except ValueError as exc:
        raise GrammarError(_short(str(exc))) from None


def limits() -> Any:
    """The `LLParserLimits` every matcher is built with (see the constants above)."""
    import llguidance

    return llguidance.LLParserLimits(
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        step_lexer_fuel=STEP_LEXER_FUEL,
        max_lexer_states=MAX_LEXER_STATES,
        max_grammar_size=MAX_GRAMMAR_SIZE,
        verbose_errors=False,
    )


def build_matcher(ll_tokenizer: Any, text: str) -> Any:
    """A fresh matcher of grammar `text`, its first mask computed (a copy's too: a broken lexer
    shows in the next matcher that uses it); `GrammarError` when it breaks."""
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer, text, log_level=0, limits=limits())
    if not matcher.is_error():
        matcher.compute_bitmask()
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(_short(probe.get_error()))
    if matcher.is_error():
        raise GrammarError(_short(matcher.get_error()))
    return matcher


class RequestGrammar:
    """One request's matcher in its start state (its own, shared with no other request),
    copied for each of its sequences."""

    def __init__(self, matcher: Any, compiled: CompiledGrammar) -> None:
        self._matcher = matcher
        self.compiled = compiled

    def state(self, max_tokens: int, gate: ThinkingGate | None = None) -> GrammarState:
        c = self.compiled
        closing_from = max_tokens - closing_window(max_tokens) if c.json else max_tokens + 1
        return GrammarState(self._matcher.deep_copy(), c.words, c.closers, closing_from, gate)


class CompiledGrammar:
    """A grammar checked for one tokenizer: its llguidance text, a fresh matcher per request."""

    def __init__(
        self, text: str, ll_tokenizer: Any, vocab_size: int, closers: Closers, json: bool
    ) -> None:
        self.text = text
        self._ll_tokenizer = ll_tokenizer
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self.closers = closers
        self.json = json  # only JSON closes early: in a regex or EBNF a quote is just text

    def instance(self) -> RequestGrammar:
        """A fresh matcher for one request (`GrammarError` if it breaks on its first mask)."""
        return RequestGrammar(build_matcher(self._ll_tokenizer, self.text), self)


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one model's tokenizer; thread-safe (the worker compiles
    in threads while the engine thread copies matchers)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, capacity: int = DEFAULT_CACHE_CAPACITY
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.capacity = capacity
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._closers: Closers | None = None
        self._ll_lock = threading.Lock()
        self.compiles = 0  # cache misses, for tests and benchmarks

    @property
    def ll_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary (built on first use: ~0.3 s for 49k tokens)."""
        with self._ll_lock:
            if self._ll_tokenizer is None:
                import llguidance

                backend = self._tokenizer.backend
                if not hasattr(backend, "to_str"):
                    raise GrammarError("structured output needs a fast (tokenizers) tokenizer")
                eos = sorted(self._tokenizer.eos_token_ids) or None
                self._ll_tokenizer = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self.vocab_size, eos_token=eos
                )
            return self._ll_tokenizer

    @property
    def closers(self) -> Closers:
        """The tokens made only of `"`, `}` and `]`, by whether they start with `"` (built once)."""
        with self._ll_lock:
            if self._closers is None:
                backend = self._tokenizer.backend
                n = self._tokenizer.vocab_size
                texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=True)
                quote = torch.zeros(self.vocab_size, dtype=torch.bool)
                brace = torch.zeros(self.vocab_size, dtype=torch.bool)
                for i, text in enumerate(texts):
                    if text and set(text) <= CLOSER_CHARS:
                        (quote if text[0] == '"' else brace)[i] = True
                self._closers = Closers(quote, brace)
            return self._closers

    def cached(self, structured: StructuredOutput) -> CompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(structured.key)
            if compiled is not None:
                self._cache.move_to_end(structured.key)
            return compiled

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar (from the cache when there); `GrammarError` naming the problem."""
        compiled = self.cached(structured)
        return compiled if compiled is not None else self._compile(structured)[0]

    def prepare(self, structured: StructuredOutput) -> RequestGrammar:
        """A fresh matcher for one request of `structured` (its grammar compiled, or from the
        cache); `GrammarError` naming the problem. Runs off the engine's thread."""
        compiled = self.cached(structured)
        return compiled.instance() if compiled is not None else self._compile(structured)[1]

    def _compile(self, structured: StructuredOutput) -> tuple[CompiledGrammar, RequestGrammar]:
        text = grammar_text(structured)
        try:
            matcher = build_matcher(self.ll_tokenizer, text)
        except GrammarError:
            if structured.kind is not StructuredKind.JSON_SCHEMA:
                raise
            # Maybe the string bound made a pattern unsatisfiable: the schema as given.
            text = grammar_text(structured, strings_bounded=False)
            matcher = build_matcher(self.ll_tokenizer, text)
        json_kinds = (StructuredKind.JSON_OBJECT, StructuredKind.JSON_SCHEMA)
        compiled = CompiledGrammar(
            text, self.ll_tokenizer, self.vocab_size, self.closers, structured.kind in json_kinds
        )
        # Cached only once it built: a grammar that broke is compiled (and refused) again.
        with self._lock:
            self.compiles += 1
            self._cache[structured.key] = compiled
            self._cache.move_to_end(structured.key)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return compiled, RequestGrammar(matcher, compiled)

    def matcher(self, structured: StructuredOutput, max_tokens: int) -> GrammarState:
        """A new sequence's own matcher (n>1: one each) for its `structured` output: a copy of
        its request's fresh matcher (`prepare`), never a matcher another request used."""
        prepared = structured.compiled
        if not isinstance(prepared, RequestGrammar):  # a direct engine caller: prepare here
            prepared = self.prepare(structured)
        return prepared.state(max_tokens, structured.gate)
