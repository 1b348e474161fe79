"""Constrained decoding inside the engine, on a tiny random model (its output is noise, so every
valid answer here is the grammar's doing): choices, regexes and JSON schemas with n>1, greedy and
random rows, batches that mix grammar and free rows, chunked prefill with prefix caching,
preemption, max_tokens running out, the compile cache, and a broken matcher failing only its
own request."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from modelyard.engine.grammar import (
    DEFAULT_MAX_PATTERN_CHARS,
    GrammarCompiler,
    GrammarError,
    bound_strings,
)
from modelyard.engine.llm_engine import LLMEngine, RequestOutput
from modelyard.engine.sampling_params import SamplingParams
from modelyard.engine.structured import StructuredKind, StructuredOutput
from tests.parity import make_engine

PROMPT = list(range(10, 45))
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
# A finite language, so that even a random model must finish it well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,3}$"},
            "maxItems": 2,
        },
    },
    "required": ["color", "count", "ok", "tags"],
    "additionalProperties": False,
}


def schema_output() -> StructuredOutput:
    return StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama, max_tokens_cap=256)


def run_all(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, dict]:
    """Run the requests together; per request, per choice: text, tokens, finish reason."""
    for rid, params in requests.items():
        engine.add_request(rid, PROMPT, params)
    results: dict[str, dict] = {rid: {} for rid in requests}
    errors: dict[str, Exception] = {}
    while engine.has_unfinished():
        out: RequestOutput
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            for d in out.deltas:
                c = results[out.request_id].setdefault(
                    d.index, {"text": "", "tokens": [], "finish": None}
                )
                c["text"] += d.text
                c["tokens"] += d.token_ids
                c["finish"] = d.finish_reason or c["finish"]
    for rid, exc in errors.items():
        results[rid] = {"error": exc}
    return results


def test_choice_regex_and_schema_with_n_greedy_and_random(engine: LLMEngine) -> None:
    choices = ["alpha", "beta gamma", "δ"]
    # [0-9], not \d: llguidance's \d is any Unicode digit, Python 3.11's `re` knows fewer.
    regex = r"[a-c]{3}-[0-9]{2}"
    requests = {
        "choice": SamplingParams(
            n=3,
            max_tokens=32,
            temperature=1.0,
            seed=1,
            structured=StructuredOutput(StructuredKind.CHOICE, json.dumps(choices)),
        ),
        "regex": SamplingParams(
            n=2, max_tokens=32, temperature=1.0, structured=StructuredOutput("regex", regex)
        ),
        "schema": SamplingParams(n=2, max_tokens=128, temperature=1.0, structured=schema_output()),
        "schema-greedy": SamplingParams(
            max_tokens=128, temperature=0.0, structured=schema_output()
        ),
    }
    out = run_all(engine, requests)
    for c in out["choice"].values():
        assert c["text"] in choices and c["finish"] == "stop"
    for c in out["regex"].values():
        assert re.fullmatch(regex, c["text"]), c
    for rid in ("schema", "schema-greedy"):
        assert len(out[rid]) == len(list(range(requests[rid].n)))
        for c in out[rid].values():
            assert c["finish"] == "stop", c
            jsonschema.validate(json.loads(c["text"]), SCHEMA)


def test_free_rows_are_unchanged_by_grammar_rows_in_the_same_step(engine: LLMEngine) -> None:
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = run_all(engine, {"free": free})["free"][0]["tokens"]
    mixed = run_all(
        engine,
        {
            "g1": SamplingParams(max_tokens=64, temperature=0.0, structured=schema_output()),
            "free": free,
            "g2": SamplingParams(max_tokens=64, temperature=1.0, structured=schema_output()),
        },
    )
    assert mixed["free"][0]["tokens"] == alone
    jsonschema.validate(json.loads(mixed["g1"][0]["text"]), SCHEMA)


def test_max_tokens_before_the_grammar_completes_is_length(engine: LLMEngine) -> None:
    out = run_all(
        engine, {"short": SamplingParams(max_tokens=3, temperature=0.0, structured=schema_output())}
    )
    c = out["short"][0]
    assert c["finish"] == "length" and len(c["tokens"]) == 3 and c["text"].startswith("{")


def test_chunked_prefill_prefix_cache_and_preemption_keep_outputs_valid(tiny_llama: Path) -> None:
    # A tiny KV cache and token budget: long prompts prefill in chunks, the second request with
    # the same prompt hits the prefix cache, and eight sequences cannot all stay resident.
    engine = make_engine(
        tiny_llama, kv_cache_memory=96 * 1024, max_num_batched_tokens=32, max_tokens_cap=256
    )
    prompt = list(range(10, 90))
    params = SamplingParams(n=4, max_tokens=128, temperature=1.0, structured=schema_output())
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, params)
    texts: dict[tuple[str, int], str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            for d in out.deltas:
                texts[(out.request_id, d.index)] = texts.get((out.request_id, d.index), "") + d.text
    assert engine.scheduler.num_preemptions > 0
    assert len(texts) == 8
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_broken_matcher_fails_only_its_request(engine: LLMEngine) -> None:
    good = SamplingParams(max_tokens=64, temperature=0.0, structured=schema_output())
    engine.add_request("good", PROMPT, good)
    engine.add_request("bad", PROMPT, good)
    engine.step()  # both prefilled, one token each
    bad = engine._requests["bad"].seqs[0]
    assert bad.grammar is not None
    bad.grammar.matcher.consume_token(engine.tokenizer.token_id("<|im_end|>"))  # refused: broken
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    assert results["bad"].error is not None
    assert results["good"].error is None


def test_matcher_is_rebuilt_from_the_tokens_when_out_of_step(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=64, temperature=0.0, structured=schema_output())
    engine.add_request("r", PROMPT, params)
    engine.step()
    engine.step()
    seq = engine._requests["r"].seqs[0]
    assert seq.grammar is not None
    seq.grammar.matcher.reset()  # as if its state were lost (e.g. a recomputed sequence)
    seq.grammar.consumed = 0
    text = seq.output_token_ids
    while engine.has_unfinished():
        engine.step()
    out = engine.tokenizer.decode(seq.output_token_ids)
    assert out.startswith(engine.tokenizer.decode(text))
    jsonschema.validate(json.loads(out), SCHEMA)


def test_compile_cache_and_errors(engine: LLMEngine) -> None:
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, capacity=2)
    first = compiler.compile(schema_output())
    assert compiler.compile(schema_output()) is first and compiler.compiles == 1
    compiler.compile(StructuredOutput(StructuredKind.REGEX, "a+"))
    compiler.compile(StructuredOutput(StructuredKind.REGEX, "b+"))
    assert compiler.cached(schema_output()) is None  # evicted: least recently used
    bad = [
        StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": "objekt"}'),
        StructuredOutput(StructuredKind.JSON_SCHEMA, "not json"),
        StructuredOutput(StructuredKind.REGEX, "(("),
        StructuredOutput(StructuredKind.GRAMMAR, "root ::= (("),
        StructuredOutput(StructuredKind.CHOICE, "[]"),
    ]
    for structured in bad:
        with pytest.raises(GrammarError):
            compiler.compile(structured)


def test_ebnf_grammar_in_lark_and_gbnf(engine: LLMEngine) -> None:
    lark = 'start: "x=" NUM\nNUM: /[0-9]{1,3}/'
    gbnf = 'root ::= "y=" [0-9] [0-9]?'
    out = run_all(
        engine,
        {
            "lark": SamplingParams(
                max_tokens=16,
                temperature=1.0,
                structured=StructuredOutput(StructuredKind.GRAMMAR, lark),
            ),
            "gbnf": SamplingParams(
                max_tokens=16,
                temperature=1.0,
                structured=StructuredOutput(StructuredKind.GRAMMAR, gbnf),
            ),
        },
    )
    assert re.fullmatch(r"x=[0-9]{1,3}", out["lark"][0]["text"])
    assert re.fullmatch(r"y=[0-9]{1,2}", out["gbnf"][0]["text"])


def test_tensor_parallel_rank_zero_applies_the_grammar(tiny_llama: Path) -> None:
    """Rank 0 samples for the group, so a grammar works with tensor parallelism unchanged."""
    tp = make_engine(tiny_llama, tensor_parallel_size=2, max_tokens_cap=256)
    try:
        params = SamplingParams(n=2, max_tokens=128, temperature=1.0, structured=schema_output())
        for c in run_all(tp, {"tp": params})["tp"].values():
            assert c["finish"] == "stop"
            jsonschema.validate(json.loads(c["text"]), SCHEMA)
    finally:
        tp.close()


def test_stop_strings_still_cut_a_constrained_output(engine: LLMEngine) -> None:
    choice = StructuredOutput(StructuredKind.CHOICE, json.dumps(["left right"]))
    out = run_all(
        engine,
        {"cut": SamplingParams(max_tokens=32, temperature=0.0, stop=(" ",), structured=choice)},
    )
    assert out["cut"][0] == {"text": "left", "tokens": out["cut"][0]["tokens"], "finish": "stop"}


def test_a_rambling_string_is_closed_before_max_tokens(engine: LLMEngine) -> None:
    """The tiny model never ends a free string by itself; in the last tokens of its budget the
    grammar prefers closing tokens, so the answer still parses (finish stop, within budget)."""
    schema = {
        "type": "object",
        "properties": {"note": {"type": "string"}, "more": {"type": "string"}},
        "required": ["note", "more"],
        "additionalProperties": False,
    }
    structured = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))
    params = SamplingParams(n=4, max_tokens=48, temperature=1.0, structured=structured)
    for c in run_all(engine, {"ramble": params})["ramble"].values():
        assert c["finish"] == "stop" and len(c["tokens"]) <= 48, c
        jsonschema.validate(json.loads(c["text"]), schema)


def test_unbounded_email_and_pattern_strings_end_within_the_budget(engine: LLMEngine) -> None:
    """An email or a pattern may be unable to close where the model is, so such strings with no
    maxLength get one (`bound_strings`): at temperature 1 the noise model still ends them."""
    schema = {
        "type": "object",
        "properties": {"email": {"type": "string", "format": "email"},
                       "code": {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$"}},
        "required": ["email", "code"],
        "additionalProperties": False,
    }  # fmt: skip
    assert bound_strings(schema)["properties"]["email"]["maxLength"] == DEFAULT_MAX_PATTERN_CHARS
    assert "maxLength" not in bound_strings({"type": "string", "format": "date"})
    assert bound_strings({"type": "string", "maxLength": 9, "pattern": "a"})["maxLength"] == 9
    structured = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))
    params = SamplingParams(n=4, max_tokens=200, temperature=1.0, seed=5, structured=structured)
    for c in run_all(engine, {"email": params})["email"].values():
        assert c["finish"] == "stop", c
        jsonschema.validate(json.loads(c["text"]), schema, format_checker=FORMATS)
    # A pattern longer than the bound is compiled as the schema gives it (no error).
    long = {"type": "object", "properties": {"k": {"type": "string", "pattern": "^[a-z]{80}$"}}}
    engine.grammars.compile(StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(long)))


def test_only_json_closes_early(engine: LLMEngine) -> None:
    """In a regex a quote is text like any other: its last tokens are not steered to quotes
    (with JSON's closing they would be all quotes here)."""
    regex = StructuredOutput(StructuredKind.REGEX, r"[^\n]{30}")
    params = SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=3, structured=regex)
    for c in run_all(engine, {"re": params})["re"].values():
        assert not c["text"].endswith('""""'), c


def test_parallel_and_sequential_mask_fills_agree(engine: LLMEngine) -> None:
    """The thread-pool fill (used with a GPU model) writes the same bitmasks as row by row."""
    from modelyard.engine.grammar_mask import fill_bitmasks

    prepared = engine.grammars.prepare(schema_output())
    states = [prepared.state(64) for _ in range(6)]
    for k, state in enumerate(states):  # different positions: "{", '{"', '{"color": "r'…
        for token in engine.tokenizer.encode('{"color": "red"', add_special_tokens=False)[:k]:
            state.advance(token)
    assert torch.equal(fill_bitmasks(states, parallel=True), fill_bitmasks(states))


def test_a_grammar_that_broke_is_not_reused_broken(engine: LLMEngine) -> None:
    """A regex whose matcher gives up in a step (llguidance: "too many expressions
    constructed") fails every request that asks for it: the next request with the same
    regex gets a fresh matcher, not a copy of a broken one that "completes" empty."""
    regex = StructuredOutput(StructuredKind.REGEX, "(x{1000}){1000}")
    for i in range(3):
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, structured=regex)
        result = run_all(engine, {f"broken{i}": params})[f"broken{i}"]
        assert "error" in result, result
