"""Speculative decoding with a draft model (`speculative=draft`): greedy output identical to
plain decoding (batched, streamed, stops inside accepted runs) whatever the draft proposes, the
sampling distribution preserved by rejection sampling (min(1, p/q), then max(0, p - q)) for a
draft model's q and a prompt-lookup draft's one-hot q, the draft's own KV cache given back,
metrics, and a draft of another vocabulary refused at load."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from modelyard.engine.async_engine import AsyncEngine
from modelyard.engine.draft_model import DraftMismatch, DraftModelDrafter
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.sampling_params import SamplingParams
from modelyard.engine.sequence import Sequence
from modelyard.engine.spec_decode import verify
from tests.engine.test_spec_decode import PROMPTS, REPETITIVE, greedy, run_all
from tests.parity import make_engine
from tests.tiny_models import build_model


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer random model of the same tokenizer: it mostly disagrees with the target."""
    return build_model(
        tmp_path_factory.mktemp("draft") / "llama", "llama", seed=7, num_hidden_layers=1
    )


def draft_engine(target: Path, draft: Path, **kw: object) -> LLMEngine:
    return make_engine(target, speculative="draft", speculative_model=str(draft), **kw)


def drafter_of(engine: LLMEngine) -> DraftModelDrafter:
    drafter = engine.scheduler.drafter
    assert isinstance(drafter, DraftModelDrafter)
    return drafter


@pytest.fixture()
def plain(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama, max_tokens_cap=256)


@pytest.mark.parametrize("which", ["self", "other"])
def test_greedy_output_identical(
    which: str, tiny_llama: Path, other_draft: Path, plain: LLMEngine
) -> None:
    """The target as its own draft (every draft accepted) and a model that mostly disagrees."""
    spec = draft_engine(tiny_llama, tiny_llama if which == "self" else other_draft)
    assert run_all(spec, PROMPTS, greedy()) == run_all(plain, PROMPTS, greedy())
    s = spec.spec_stats
    assert s.draft_tokens > 0 and s.emitted_tokens == s.spec_steps + s.accepted_tokens
    if which == "self":
        assert s.accepted_tokens == s.draft_tokens  # the same model: every draft agrees
        assert spec.stats.steps < plain.stats.steps
    else:
        assert s.accepted_tokens < s.draft_tokens
    assert spec.kv.pool.num_free == spec.kv.num_blocks
    drafter = drafter_of(spec)
    assert drafter.kv.pool.num_free == drafter.kv.num_blocks  # every shadow released
    assert not drafter._shadows


def test_stops_inside_accepted_runs(tiny_llama: Path, plain: LLMEngine) -> None:
    spec = draft_engine(tiny_llama, tiny_llama)
    want = run_all(plain, [REPETITIVE], greedy())["r0"]["tokens"]
    for max_tokens in range(2, 14):
        got = run_all(spec, [REPETITIVE], greedy(max_tokens))["r0"]
        assert got["tokens"] == want[:max_tokens] and got["finish"] == "length"
    stop_token = want[9]
    got = run_all(spec, [REPETITIVE], greedy(stop_token_ids=(stop_token,)))["r0"]
    assert got["tokens"] == want[: want.index(stop_token) + 1] and got["finish"] == "stop"


def test_streamed_through_the_async_engine(
    tiny_llama: Path, other_draft: Path, plain: LLMEngine
) -> None:
    want = run_all(plain, PROMPTS, greedy(40))

    async def main() -> list[list[int]]:
        engine = AsyncEngine(draft_engine(tiny_llama, other_draft))
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

    assert asyncio.run(main()) == [want[f"r{i}"]["tokens"] for i in range(len(PROMPTS))]


def _seq(params: SamplingParams, seed: int, tokens: list[int] | None = None) -> Sequence:
    tokens = tokens or [1]
    seq = Sequence(seed, "r", 0, len(tokens), list(tokens), params)
    seq.generator = torch.Generator().manual_seed(seed)
    return seq


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target never emits came out"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


CHI2_DF5_P001 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_rejection_sampling_preserves_the_distribution(drafter: str) -> None:
    """Synthetic p (the target's rows) and q (the draft's): draft tokens drawn from q (or a fixed
    token: prompt lookup's one-hot q); over 2500 seeds the first emitted token follows p's row 0
    and, when the first draft token was accepted, the second follows p's row 1 (chi-square at
    p = 0.001 over 6 tokens, and total variation)."""
    logits = torch.tensor(
        [[1.0, 0.2, 2.0, -1.0, 0.5, 0.0], [0.0, 1.5, -0.5, 0.3, 0.3, 1.0], [0.0] * 6]
    )
    q = torch.tensor(
        [[0.05, 0.05, 0.1, 0.5, 0.2, 0.1], [0.4, 0.1, 0.1, 0.1, 0.1, 0.2]]
    )  # far from p: many rejections
    params = SamplingParams(temperature=1.0)
    p = logits.softmax(dim=1)
    first = torch.zeros(6)
    second = torch.zeros(6)
    for s in range(2500):
        seq = _seq(params, s)
        if drafter == "model":
            g = torch.Generator().manual_seed(10_000 + s)
            draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            seq.draft_probs = q
        else:
            draft = [2, 3]  # p(2) ~ 0.5, p(3) small: rejected often at each position
        out = verify(logits, seq, draft)
        first[out[0]] += 1
        if len(out) >= 2:  # the first draft token was accepted: the second was verified
            second[out[1]] += 1
    for counts, row in ((first, p[0]), (second, p[1])):
        assert counts.sum() > 300
        assert _chi2(counts, row) < CHI2_DF5_P001, (counts, row)
        assert 0.5 * (counts / counts.sum() - row).abs().sum() < 0.05


def test_draft_model_sampling_matches_the_target(
    tiny_llama: Path, other_draft: Path, plain: LLMEngine
) -> None:
    """On the tiny models: the real drafter samples k tokens from the draft model's q for each
    seed, the target's verifying step gives p, and the first emitted token over 800 seeds
    follows the target's softmax (temperature 0.7) as closely as the plain sampler's draws."""
    engine = draft_engine(tiny_llama, other_draft)
    drafter = drafter_of(engine)
    prompt = REPETITIVE
    params = SamplingParams(temperature=0.7, max_tokens=16)
    ref = Sequence(0, "q", 0, len(prompt), list(prompt), params)
    assert plain.kv.allocate(ref, len(prompt))
    want = plain.runner.execute(plain.runner.prepare([(ref, len(prompt))]))[0]
    target = (want / 0.7).softmax(0)

    seq = Sequence(1, "p", 0, len(prompt), list(prompt), params)
    assert engine.kv.allocate(seq, len(prompt) - 1)
    engine.runner.execute(engine.runner.prepare([(seq, len(prompt) - 1)]))
    seq.num_computed_tokens = len(prompt) - 1
    n = 800
    spec_counts = torch.zeros_like(target)
    plain_counts = torch.zeros_like(target)
    rejected = 0
    for s in range(n):
        seq.generator = torch.Generator().manual_seed(s)
        seq.draft = drafter(seq, 4)
        assert len(seq.draft) == 4 and seq.draft_probs is not None
        assert engine.kv.allocate(seq, 1 + len(seq.draft))
        logits = engine.runner.execute(engine.runner.prepare([(seq, 1 + len(seq.draft))]))
        if s == 0:
            torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)
        out = verify(logits, seq, seq.draft)
        rejected += out[0] != seq.draft[0]
        spec_counts[out[0]] += 1
        plain_counts[plain.sampler(want.unsqueeze(0), [_seq(params, s)])[0][0]] += 1
        engine.kv.trim(seq)
    assert rejected > 20  # the other model's drafts are often rejected: the residual is drawn
    tv_spec = 0.5 * (spec_counts / n - target).abs().sum()
    tv_plain = 0.5 * (plain_counts / n - target).abs().sum()
    assert tv_spec < 1.5 * tv_plain + 0.02, (tv_spec, tv_plain)
    drafter.release(seq)
    assert drafter.kv.pool.num_free == drafter.kv.num_blocks


def test_sampled_requests_run_to_the_end(tiny_llama: Path, other_draft: Path) -> None:
    """Sampled requests with drafts (seeded: the same output twice), with n=2 and top-p."""
    spec = draft_engine(tiny_llama, other_draft)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, n=2, ignore_eos=True)
    a = run_all(spec, PROMPTS[:2], params)
    b = run_all(spec, PROMPTS[:2], params)
    assert a == b
    assert all(len(c["tokens"]) == 24 for c in a.values())
    assert spec.spec_stats.draft_tokens > 0
    drafter = drafter_of(spec)
    assert drafter.kv.pool.num_free == drafter.kv.num_blocks


def test_metrics(tiny_llama: Path) -> None:
    from modelyard.engine.client import LocalEngineClient
    from modelyard.worker.metrics import WorkerMetrics

    spec = draft_engine(tiny_llama, tiny_llama)
    run_all(spec, [REPETITIVE], greedy(40))
    s = spec.spec_stats
    text = WorkerMetrics(LocalEngineClient(AsyncEngine(spec)), "tiny").render().decode()
    assert 'modelyard_spec_decode_acceptance_rate{model="tiny"} 1.0' in text
    rate = s.emitted_tokens / s.spec_steps
    assert rate > 1.0
    assert f'modelyard_spec_decode_tokens_per_step{{model="tiny"}} {rate}' in text


def test_a_draft_of_another_vocabulary_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    other = build_model(tmp_path / "wide", "llama", vocab_size=512)
    with pytest.raises(DraftMismatch, match="speculative_model has vocab_size 512"):
        draft_engine(tiny_llama, other)
