"""Speculative decoding by prompt lookup: the n-gram proposer, greedy output identical to plain
decoding (batched, streamed, with stops landing inside accepted runs), the sampling distribution
preserved, and the KV of rejected drafts rolled back without tainting the prefix cache."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from modelyard.engine.async_engine import AsyncEngine
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.sampling_params import SamplingParams
from modelyard.engine.sequence import Sequence
from modelyard.engine.spec_decode import propose_ngram, verify
from tests.parity import make_engine

REPETITIVE = [5, 6, 7, 8] * 10
PROMPTS = [list(range(10, 45)), REPETITIVE, list(range(100, 130)) + list(range(100, 120))]


def greedy(max_tokens: int = 60, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out: dict[str, dict] = {}
    while engine.has_unfinished():
        for o in engine.step():
            c = out.setdefault(o.request_id, {"tokens": [], "text": "", "finish": None})
            for d in o.deltas:
                c["tokens"] += d.token_ids
                c["text"] += d.text
                c["finish"] = d.finish_reason or c["finish"]
    return out


@pytest.fixture()
def spec(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama, speculative="ngram", max_tokens_cap=256)


@pytest.fixture()
def plain(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama, max_tokens_cap=256)


def test_propose_ngram() -> None:
    assert propose_ngram([1, 2, 3, 9, 9, 1, 2, 3], 2, 3, 2) == [9, 9]  # the 3-gram 1 2 3
    assert propose_ngram([1, 2, 3, 4, 1, 2], 2, 3, 5) == [3, 4, 1, 2]  # what follows, to the end
    assert propose_ngram([7, 2, 5, 2, 3, 2], 1, 3, 1) == [3]  # the most recent occurrence of 2
    assert propose_ngram([1, 2, 3, 4], 1, 3, 4) == []  # nothing repeats
    assert propose_ngram([1, 2, 1, 2], 2, 2, 0) == []
    # 2 and 256 pack to bytes that also match across token boundaries: only whole tokens count.
    assert propose_ngram([0, 2, 256, 0, 5, 512, 1, 2, 256], 2, 2, 2) == [0, 5]
    assert propose_ngram([9, 9, 9], 2, 4, 3) == [9]


def test_greedy_output_identical_with_acceptances(spec: LLMEngine, plain: LLMEngine) -> None:
    assert run_all(spec, PROMPTS, greedy()) == run_all(plain, PROMPTS, greedy())
    s = spec.spec_stats
    assert s.draft_tokens > 0 and s.accepted_tokens > 0
    assert s.emitted_tokens == s.spec_steps + s.accepted_tokens
    assert spec.stats.steps < plain.stats.steps  # accepted drafts saved steps
    assert spec.kv.pool.num_free == spec.kv.num_blocks  # every block given back


def test_stops_inside_accepted_runs(spec: LLMEngine, plain: LLMEngine) -> None:
    want = run_all(plain, [REPETITIVE], greedy())["r0"]["tokens"]
    # max_tokens at every length: most of them end inside a run of accepted draft tokens.
    for max_tokens in range(2, 30):
        got = run_all(spec, [REPETITIVE], greedy(max_tokens))["r0"]
        assert got["tokens"] == want[:max_tokens] and got["finish"] == "length"
    assert spec.spec_stats.accepted_tokens > 0
    for cut in (5, 11, 17):  # a stop token and a stop string met mid-draft
        stop_token = want[cut]
        first = want.index(stop_token)
        got = run_all(spec, [REPETITIVE], greedy(stop_token_ids=(stop_token,)))["r0"]
        assert got["tokens"] == want[: first + 1] and got["finish"] == "stop"
        text = spec.tokenizer.decode(want[: cut + 1])
        stop = text[-3:]
        plain_out = run_all(plain, [REPETITIVE], greedy(stop=(stop,)))["r0"]
        spec_out = run_all(spec, [REPETITIVE], greedy(stop=(stop,)))["r0"]
        assert spec_out == plain_out and spec_out["finish"] == "stop"


def test_streamed_through_the_async_engine(tiny_llama: Path, plain: LLMEngine) -> None:
    want = run_all(plain, PROMPTS, greedy(40))

    async def main() -> list[list[int]]:
        engine = AsyncEngine(make_engine(tiny_llama, speculative="ngram"))
        engine.start()
        try:

            async def one(prompt: list[int]) -> list[int]:
                tokens: list[int] = []
                async for out in engine.generate(prompt, greedy(40)):
                    tokens += [t for d in out.deltas for t in d.token_ids]
                return tokens

            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            engine.shutdown()

    got = asyncio.run(main())
    assert got == [want[f"r{i}"]["tokens"] for i in range(len(PROMPTS))]


def test_rollback_keeps_the_prefix_cache_right(spec: LLMEngine, plain: LLMEngine) -> None:
    first = run_all(spec, [REPETITIVE], greedy(50))["r0"]["tokens"]
    assert spec.spec_stats.draft_tokens > spec.spec_stats.accepted_tokens > 0  # some rejected
    # A prompt that is the first request's whole text reuses its published blocks, which hold
    # the KV of accepted and bonus tokens only: its output must be the plain engine's.
    longer = REPETITIVE + first
    hits_before = spec.kv.prefix_hits
    got = run_all(spec, [longer], greedy(30))["r0"]["tokens"]
    assert spec.kv.prefix_hits - hits_before >= 16 * ((len(longer) - 1) // 16) - 16
    assert got == run_all(plain, [longer], greedy(30))["r0"]["tokens"]


def test_penalties_and_logprobs_are_not_speculated(spec: LLMEngine) -> None:
    run_all(spec, [REPETITIVE], greedy(20, repetition_penalty=1.2))
    run_all(spec, [REPETITIVE], greedy(20, logprobs=2))
    assert spec.spec_stats.draft_tokens == 0


def _seq(params: SamplingParams, seed: int) -> Sequence:
    seq = Sequence(0, "r", 0, 1, [1], params)
    seq.generator = torch.Generator().manual_seed(seed)
    return seq


def test_rejection_sampling_preserves_the_distribution() -> None:
    """Draft token 2 (likely) and 0 (unlikely) at position one: whatever the draft, the first
    emitted token is distributed as the target's softmax (total variation over 4000 seeds)."""
    vocab = 6
    logits = torch.tensor([[1.0, 0.2, 2.0, -1.0, 0.5, 0.0]] + [[0.0] * vocab] * 2)
    target = logits[0].softmax(0)
    params = SamplingParams(temperature=1.0)
    for draft in ([2, 3], [0, 1], [5, 5]):
        counts = torch.zeros(vocab)
        for seed in range(4000):
            counts[verify(logits, _seq(params, seed), draft)[0]] += 1
        tv = 0.5 * (counts / counts.sum() - target).abs().sum()
        assert tv < 0.03, (draft, tv)
    # Top-k 2 filters the target first: only its two best tokens may come out.
    top2 = SamplingParams(temperature=1.0, top_k=2)
    firsts = {verify(logits, _seq(top2, s), [3, 3])[0] for s in range(200)}
    assert firsts == {0, 2}


def test_engine_sampling_matches_the_target(tiny_llama: Path, plain: LLMEngine) -> None:
    """On the tiny model: a decode step verifying a draft gives, at its first position, the
    logits of a plain step, and the token it emits there over many seeds follows the target's
    softmax (temperature 0.5) as closely as the plain sampler's draws do."""
    engine = make_engine(tiny_llama, speculative="ngram")
    prompt = REPETITIVE
    seq = Sequence(0, "p", 0, len(prompt), list(prompt), greedy(8))
    assert engine.kv.allocate(seq, len(prompt) - 1)
    engine.runner.execute(engine.runner.prepare([(seq, len(prompt) - 1)]))
    seq.num_computed_tokens = len(prompt) - 1
    seq.draft = propose_ngram(prompt, 2, 4, 4)
    assert seq.draft == [5, 6, 7, 8]
    assert engine.kv.allocate(seq, 1 + len(seq.draft))
    logits = engine.runner.execute(engine.runner.prepare([(seq, 1 + len(seq.draft))]))
    assert logits.shape[0] == 5

    ref = Sequence(1, "q", 0, len(prompt), list(prompt), greedy(8))
    assert plain.kv.allocate(ref, len(prompt))
    want = plain.runner.execute(plain.runner.prepare([(ref, len(prompt))]))[0]
    torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)

    params = SamplingParams(temperature=0.5)
    target = (want / 0.5).softmax(0)
    n = 3000
    spec_counts = torch.zeros_like(target)
    plain_counts = torch.zeros_like(target)
    for s in range(n):
        spec_counts[verify(logits, _seq(params, s), seq.draft)[0]] += 1
        plain_counts[plain.sampler(want.unsqueeze(0), [_seq(params, s)])[0][0]] += 1
    tv_spec = 0.5 * (spec_counts / n - target).abs().sum()
    tv_plain = 0.5 * (plain_counts / n - target).abs().sum()
    assert tv_spec < 1.5 * tv_plain + 0.02, (tv_spec, tv_plain)


def test_metrics(spec: LLMEngine) -> None:
    from modelyard.engine.client import LocalEngineClient
    from modelyard.worker.metrics import WorkerMetrics

    run_all(spec, [REPETITIVE], greedy(40))
    s = spec.spec_stats
    client = LocalEngineClient(AsyncEngine(spec))
    snap = client.snapshot()
    assert (snap.spec_drafts, snap.spec_draft_tokens) == (s.spec_steps, s.draft_tokens)
    text = WorkerMetrics(client, "tiny").render().decode()
    accepted = (
        f'vllm:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {s.accepted_tokens}.0'
    )
    assert accepted in text
    rate = s.accepted_tokens / s.draft_tokens
    assert f'modelyard_spec_decode_acceptance_rate{{model="tiny"}} {rate}' in text
    assert (
        f'modelyard_spec_decode_tokens_per_step{{model="tiny"}} {s.emitted_tokens / s.spec_steps}'
        in text
    )
