"""LLMEngine behaviour on a tiny model: stop rules, n>1, seeds, prefix caching, abort, limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelyard.engine.llm_engine import LLMEngine, RequestOutput, RequestRejected
from modelyard.engine.sampling_params import SamplingParams
from tests.parity import make_engine

PROMPT = list(range(10, 45))  # 35 tokens: two full blocks of 16 and a partial one


@pytest.fixture()
def engine(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama, max_tokens_cap=256)


def run(
    engine: LLMEngine,
    prompt: list[int],
    params: SamplingParams,
    rid: str = "r",
    cache_salt: str | None = None,
) -> dict:
    engine.add_request(rid, prompt, params, cache_salt=cache_salt)
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    choices: dict[int, dict] = {}
    for o in outs:
        for d in o.deltas:
            c = choices.setdefault(d.index, {"text": "", "tokens": [], "finish": None})
            c["text"] += d.text
            c["tokens"] += d.token_ids
            c["finish"] = d.finish_reason or c["finish"]
    last = outs[-1]
    assert last.finished
    return {"choices": choices, "usage": last}


def greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def test_max_tokens_finishes_with_length(engine: LLMEngine) -> None:
    out = run(engine, PROMPT, greedy(7, ignore_eos=True))
    c = out["choices"][0]
    assert len(c["tokens"]) == 7 and c["finish"] == "length"
    assert out["usage"].completion_tokens == 7 and out["usage"].prompt_tokens == len(PROMPT)


def test_stop_string_and_stop_token(engine: LLMEngine) -> None:
    full = run(engine, PROMPT, greedy(24, ignore_eos=True))["choices"][0]
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"degenerate text {text!r}"
    cut = run(engine, PROMPT, greedy(24, ignore_eos=True, stop=(stop,)), "s")["choices"][0]
    assert cut["finish"] == "stop" and cut["text"] == text[: text.index(stop)]

    stop_token = full["tokens"][5]
    first = full["tokens"].index(stop_token)
    by_token = run(engine, PROMPT, greedy(24, ignore_eos=True, stop_token_ids=(stop_token,)), "t")
    c = by_token["choices"][0]
    assert c["finish"] == "stop" and c["tokens"] == full["tokens"][: first + 1]


def test_eos_stops_unless_ignored(engine: LLMEngine) -> None:
    full = run(engine, PROMPT, greedy(24, ignore_eos=True))["choices"][0]
    eos = full["tokens"][3]
    params = greedy(24, extra_eos_token_ids=frozenset({eos}))
    c = run(engine, PROMPT, params, "e")["choices"][0]
    assert c["finish"] == "stop" and c["tokens"][-1] == eos
    assert len(c["tokens"]) == full["tokens"].index(eos) + 1


def test_n_choices_with_seed_are_reproducible_and_share_the_prompt(engine: LLMEngine) -> None:
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    a = run(engine, PROMPT, params, "a")
    b = run(engine, PROMPT, params, "b")
    tokens_a = [a["choices"][i]["tokens"] for i in range(3)]
    assert tokens_a == [b["choices"][i]["tokens"] for i in range(3)]
    assert len({tuple(t) for t in tokens_a}) > 1  # the choices differ from each other
    assert a["usage"].prompt_tokens == len(PROMPT)  # the prompt is billed once
    assert a["usage"].completion_tokens == 36


def test_prefix_cache_hit_is_reported_and_changes_nothing(engine: LLMEngine) -> None:
    first = run(engine, PROMPT, greedy(10, ignore_eos=True), "1")
    second = run(engine, PROMPT, greedy(10, ignore_eos=True), "2")
    assert first["usage"].cached_tokens == 0
    assert second["usage"].cached_tokens == 32  # two full blocks of 16
    assert first["choices"][0]["tokens"] == second["choices"][0]["tokens"]


def test_cache_salt_is_a_prefix_cache_namespace(engine: LLMEngine) -> None:
    def cached(rid: str, salt: str | None) -> tuple[int, list[int]]:
        out = run(engine, PROMPT, greedy(6, ignore_eos=True), rid, salt)
        return out["usage"].cached_tokens, out["choices"][0]["tokens"]

    a1, tokens = cached("a1", "tenant-a")
    assert a1 == 0
    assert cached("a2", "tenant-a") == (32, tokens)  # the same salt shares, as before
    assert cached("b1", "tenant-b") == (0, tokens)  # another tenant's salt sees no hit
    assert cached("none1", None) == (0, tokens)  # nor does a request without one
    assert cached("none2", None) == (32, tokens)  # which shares with its own kind


def test_abort_frees_blocks_at_once(engine: LLMEngine) -> None:
    engine.add_request("x", PROMPT, greedy(100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_free < engine.kv.num_blocks
    assert engine.abort_request("x")
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    assert not engine.has_unfinished() and engine.num_running == 0


def test_requests_that_can_never_run_are_rejected(tiny_llama: Path) -> None:
    # 512 bytes a token; 4 blocks of 16 tokens = 64 tokens of KV cache.
    engine = make_engine(tiny_llama, kv_cache_memory=512 * 16 * 4, max_tokens_cap=100)
    with pytest.raises(RequestRejected, match="KV cache"):
        engine.check_request(PROMPT, greedy(40))
    with pytest.raises(RequestRejected, match="cap"):
        engine.check_request(PROMPT, greedy(101))
    with pytest.raises(RequestRejected, match="maximum context length"):
        engine.check_request([7] * 500, greedy(20))
    with pytest.raises(RequestRejected, match="empty"):
        engine.check_request([], greedy(1))
    with pytest.raises(RequestRejected, match="token ids"):
        engine.check_request([10**6], greedy(1))
    assert not engine.has_unfinished()


# ----- a step that fails fails only its own requests ---------------------------------------------


def test_a_request_that_breaks_the_sampler_fails_alone(engine: LLMEngine) -> None:
    # Forced past admission (which refuses top_k above the vocabulary): the sampler's topk
    # raises in a step shared with innocent requests, which must not notice.
    engine.add_request("ok-1", PROMPT, greedy(6, ignore_eos=True))
    engine.add_request("poison", PROMPT[:20], SamplingParams(max_tokens=6, top_k=100_000))
    engine.add_request("ok-2", PROMPT[5:], SamplingParams(max_tokens=6, seed=1, ignore_eos=True))
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    (failed,) = outs["poison"]
    assert failed.finished and failed.error is not None and "k out of range" in str(failed.error)
    for rid in ("ok-1", "ok-2"):
        assert outs[rid][-1].finished and outs[rid][-1].error is None
        assert sum(len(d.token_ids) for o in outs[rid] for d in o.deltas) == 6
    assert engine.stats.failed_steps == 1
    assert engine.stats.requests_finished == {"error": 1, "length": 2}
    assert engine.kv.pool.num_free == engine.kv.num_blocks and engine.num_running == 0
    # Later requests run as before, and give what a fresh engine gives.
    assert run(engine, PROMPT, greedy(6, ignore_eos=True), "after")["usage"].completion_tokens == 6


def test_a_fault_after_sampling_fails_only_that_request(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Injected: the detokenizer of one request raises (state mutated half-way through an update).
    engine.add_request("ok", PROMPT, greedy(5, ignore_eos=True))
    engine.add_request("bad", PROMPT, greedy(5, ignore_eos=True))
    detok = engine._requests["bad"].detoks[0]

    def broken(token_id: int) -> None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    monkeypatch.setattr(detok, "add_token", broken)
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["bad"][-1].error is not None and outs["ok"][-1].error is None
    assert sum(len(d.token_ids) for o in outs["ok"] for d in o.deltas) == 5
    assert engine.kv.pool.num_free == engine.kv.num_blocks
