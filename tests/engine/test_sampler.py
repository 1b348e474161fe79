"""Sampler: greedy, seeded reproducibility, top-k/top-p/min-p filters, penalties, logprobs."""

from __future__ import annotations

import torch

from modelyard.engine.sampler import Sampler
from modelyard.engine.sampling_params import SamplingParams
from modelyard.engine.sequence import Sequence


def seq(params: SamplingParams, tokens: list[int] | None = None, seq_id: int = 0) -> Sequence:
    s = Sequence(
        seq_id=seq_id,
        request_id=str(seq_id),
        index=0,
        prompt_len=1,
        token_ids=tokens or [0],
        params=params,
    )
    if params.seed is not None:
        s.generator = torch.Generator().manual_seed(params.seed)
    return s


def logits(rows: int = 1, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_pick_the_argmax() -> None:
    lg = logits(2)
    tokens, _ = Sampler()(
        lg, [seq(SamplingParams(temperature=0.0)), seq(SamplingParams(top_k=1), seq_id=1)]
    )
    assert tokens == lg.argmax(dim=1).tolist()


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    lg = logits(1, vocab=1000)

    def draw(batch_extra: int) -> list[int]:
        s = seq(SamplingParams(temperature=1.0, seed=1234))
        others = [seq(SamplingParams(temperature=1.0), seq_id=i + 1) for i in range(batch_extra)]
        out = []
        for _ in range(20):
            rows = torch.cat([lg, logits(batch_extra, vocab=1000, seed=9)]) if others else lg
            tokens, _ = Sampler()(rows, [s, *others])
            out.append(tokens[0])
        return out

    alone, batched = draw(0), draw(3)
    assert alone == batched
    assert len(set(alone)) > 1  # it does sample, not argmax
    different_seed = seq(SamplingParams(temperature=1.0, seed=99))
    other = [Sampler()(lg, [different_seed])[0][0] for _ in range(20)]
    assert other != alone


def test_top_k_and_top_p_restrict_the_support() -> None:
    lg = logits(1, vocab=100)
    top5 = set(lg[0].topk(5).indices.tolist())
    s = seq(SamplingParams(temperature=1.0, top_k=5, seed=1))
    assert {Sampler()(lg, [s])[0][0] for _ in range(200)} <= top5

    probs = lg[0].softmax(0)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    s = seq(SamplingParams(temperature=1.0, top_p=0.5, seed=2))
    drawn = {Sampler()(lg, [s])[0][0] for _ in range(300)}
    assert drawn <= nucleus and len(drawn) >= 1


def test_min_p_drops_unlikely_tokens() -> None:
    lg = torch.tensor([[5.0, 4.9, 0.0, -1.0, -2.0]])
    s = seq(SamplingParams(temperature=1.0, min_p=0.5, seed=3))
    assert {Sampler()(lg, [s])[0][0] for _ in range(200)} == {0, 1}


def test_penalties_push_away_from_repeated_tokens() -> None:
    lg = torch.tensor([[3.0, 2.9, 0.0]])
    plain = Sampler()(lg, [seq(SamplingParams(temperature=0.0), tokens=[0, 0, 0])])[0][0]
    assert plain == 0
    s = Sequence(0, "r", 0, 1, [2, 0, 0], SamplingParams(temperature=0.0, frequency_penalty=0.2))
    assert Sampler()(lg, [s])[0][0] == 1  # 3.0 - 2 * 0.2 < 2.9
    s = Sequence(0, "r", 0, 1, [2, 0], SamplingParams(temperature=0.0, presence_penalty=0.5))
    assert Sampler()(lg, [s])[0][0] == 1
    s = Sequence(0, "r", 0, 1, [0], SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert Sampler()(lg, [s])[0][0] == 1  # 3.0 / 1.2 < 2.9
    assert torch.equal(lg, torch.tensor([[3.0, 2.9, 0.0]]))  # caller's logits untouched


def test_logprobs_are_the_model_log_softmax() -> None:
    lg = logits(1)
    tokens, lps = Sampler()(lg, [seq(SamplingParams(temperature=0.0, logprobs=3))])
    ref = lg[0].log_softmax(0)
    lp = lps[0]
    assert lp is not None and lp.token_id == tokens[0]
    assert abs(lp.logprob - float(ref[tokens[0]])) < 1e-6
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
    assert Sampler()(lg, [seq(SamplingParams())])[1] == [None]
