"""`Sampler`: picks the next token of every sampling row in one batched pass.

Row-wise knobs (logit bias, temperature, top-k, top-p, min-p, penalties, seeds) are applied as
tensors over the whole batch, touching only the rows that asked for them. Sampling uses the
exponential-race form of the categorical draw (argmax of p / E, E ~ Exp(1)) so a seeded row
draws its noise from its own generator and stays reproducible whatever else shares the batch.
"""

from __future__ import annotations

import torch

from modelyard.engine.grammar_mask import apply_grammar_masks
from modelyard.engine.sequence import Sequence, TokenLogprob


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    vocab = logits.shape[1]
    device = logits.device
    for r in rows:
        p = seqs[r].params
        row = logits[r]
        if p.repetition_penalty != 1.0:
            seen = torch.unique(torch.tensor(seqs[r].token_ids, dtype=torch.long, device=device))
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if p.presence_penalty or p.frequency_penalty:
            out = torch.tensor(seqs[r].output_token_ids, dtype=torch.long, device=device)
            counts = torch.zeros(vocab, device=device).scatter_add_(
                0, out, torch.ones_like(out, dtype=torch.float32)
            )
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """OpenAI's `logit_bias`: each row's own (token, bias) pairs added to its logits."""
    for r in rows:
        ids, biases = zip(*seqs[r].params.logit_bias, strict=True)
        index = torch.tensor(ids, dtype=torch.long, device=logits.device)
        logits[r].index_add_(
            0, index, torch.tensor(biases, dtype=logits.dtype, device=logits.device)
        )


def _filter(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on random rows; filtered entries become -inf."""
    params = [s.params for s in seqs]
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temps
    top_ks = [p.top_k for p in params]
    if any(k > 0 for k in top_ks):
        vocab = logits.shape[1]
        ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=device)
        kth = logits.topk(int(ks.max()), dim=1).values
        threshold = kth.gather(1, (ks - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    top_ps = [p.top_p for p in params]
    if any(tp < 1.0 for tp in top_ps):
        sorted_logits, order = logits.sort(dim=1, descending=True)
        probs = sorted_logits.softmax(dim=1)
        before = probs.cumsum(dim=1) - probs  # mass of the strictly better tokens
        drop = before > torch.tensor(top_ps, device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    min_ps = [p.min_p for p in params]
    if any(mp > 0.0 for mp in min_ps):
        probs = logits.softmax(dim=1)
        floor = probs.max(dim=1, keepdim=True).values * torch.tensor(
            min_ps, device=device
        ).unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    probs = logits.softmax(dim=1)
    noise = torch.empty_like(probs)
    unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
    if unseeded:
        noise[unseeded] = torch.empty(
            len(unseeded), probs.shape[1], device=probs.device
        ).exponential_()
    for i, s in enumerate(seqs):
        if s.generator is not None:
            noise[i].exponential_(generator=s.generator)
    return (probs / noise).argmax(dim=1)


class Sampler:
    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        want_logprobs = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw_logprobs = logits[want_logprobs].log_softmax(dim=1) if want_logprobs else None

        penalized = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        biased = [i for i, s in enumerate(seqs) if s.params.logit_bias]
        if penalized or biased:
            logits = logits.clone()  # the logprobs above stay the model's
            _apply_penalties(logits, seqs, penalized)
            _apply_logit_bias(logits, seqs, biased)
        # Grammar rows: forbidden tokens to -inf (logprobs above stay the model's).
        logits = apply_grammar_masks(logits, seqs)

        # max's indices, not argmax: the same first maximal index, 1.5x faster over a 49k
        # vocabulary on CPU (0.9 vs 1.4 ms for 32 rows).
        next_tokens = logits.max(dim=1).indices
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if random_rows:
            sub = [seqs[i] for i in random_rows]
            next_tokens[random_rows] = _draw(_filter(logits[random_rows], sub), sub)
        token_ids: list[int] = next_tokens.tolist()

        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for j, i in enumerate(want_logprobs):
                k = seqs[i].params.logprobs or 0
                row = raw_logprobs[j]
                top: list[tuple[int, float]] = []
                if k:
                    vals, ids = row.topk(k)
                    top = list(zip(ids.tolist(), vals.tolist(), strict=True))
                logprobs[i] = TokenLogprob(token_ids[i], float(row[token_ids[i]]), top)
        return token_ids, logprobs
