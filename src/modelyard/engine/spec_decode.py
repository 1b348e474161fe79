"""Speculative decoding: drafts verified in one batched target step; prompt-lookup drafts.

A decoding sequence whose last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
occurred earlier in its prompt or output gets the tokens that followed that occurrence as a
draft. The step computes the last real token and the k draft tokens together, like a small
prefill chunk, and keeps the logits of all 1+k positions. `verify` then accepts the longest
prefix of the draft the target model agrees with and adds one token of the target's own:

- greedy: a draft token is accepted when it is the target's argmax, so the output is exactly
  the non-speculative one;
- sampling: rejection sampling. A prompt-lookup draft is a point mass (q one-hot): draft token
  t is accepted with probability p(t) (p: the target's distribution after temperature,
  top-k/p, min-p and logit bias); on rejection a token is drawn from p with t removed and
  renormalised. A draft model's token t, drawn from its own q (`Sequence.draft_probs`), is
  accepted with probability min(1, p(t) / q(t)); on rejection a token is drawn from
  max(0, p - q) renormalised. Either way each emitted token is distributed exactly as p.

A draft model proposes through `draft_model.DraftModelDrafter`, prompt lookup through
`NgramDrafter` below; both are the scheduler's `Drafter`.

Rows with penalties, logprobs or a grammar are never speculated (they decode one token a step).
The KV of rejected positions is rolled back by the engine: `num_computed_tokens` advances only
over the accepted tokens and the blocks past them are released (`KVCacheManager.trim`); a block
is published to the prefix cache only once every position in it is computed from real tokens.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Protocol

import torch

from modelyard.engine.sampler import Sampler, _apply_logit_bias, _draw, _filter
from modelyard.engine.sequence import Sequence, TokenLogprob


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram of `tokens` (n from `max_n` down to `min_n`); [] when none occurs."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    packed = array("i", tokens).tobytes()  # bytes.rfind searches in C
    width = array("i").itemsize
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = packed[(length - n) * width :]
        end = (length - 1) * width  # an occurrence must be followed by at least one token
        while True:
            at = packed.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % width == 0:
                start = at // width + n
                return tokens[start : start + k]
            end = at + len(pattern) - 1  # a match across token boundaries: look further back
    return []


def speculable(seq: Sequence) -> bool:
    """Whether a sequence may decode with drafts (others decode one token a step)."""
    p = seq.params
    return not p.has_penalties and p.logprobs is None and seq.grammar is None


class Drafter(Protocol):
    """Proposes a decoding sequence's draft for the scheduler."""

    def __call__(self, seq: Sequence, budget: int) -> list[int]:
        """The draft for `seq`'s next step, of at most `budget` tokens ([] for none)."""
        ...

    def release(self, seq: Sequence) -> None:
        """The sequence left the scheduler (finished or aborted): drop what is kept for it."""
        ...


@dataclass
class NgramDrafter:
    """Proposes a decoding sequence's draft for the scheduler, within its limits."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    max_model_len: int

    def __call__(self, seq: Sequence, budget: int) -> list[int]:
        """The draft for `seq`'s next step, of at most `budget` tokens ([] for none)."""
        if not speculable(seq):
            return []
        k = draft_length(seq, self.num_speculative_tokens, budget, self.max_model_len)
        return propose_ngram(seq.token_ids, self.prompt_lookup_min, self.prompt_lookup_max, k)

    def release(self, seq: Sequence) -> None:
        """Nothing is kept per sequence."""


@dataclass
class SpecStats:
    """Counters since start."""

    draft_tokens: int = 0  # proposed and verified
    accepted_tokens: int = 0  # of those, accepted
    spec_steps: int = 0  # sequence-steps that verified a draft
    emitted_tokens: int = 0  # tokens those sequence-steps produced (accepted + one each)

    def record(self, proposed: int, emitted: int) -> None:
        self.draft_tokens += proposed
        self.accepted_tokens += emitted - 1
        self.spec_steps += 1
        self.emitted_tokens += emitted


def _uniform(seq: Sequence, device: torch.device) -> float:
    return float(torch.rand(1, generator=seq.generator, device=device).item())


def verify(logits: torch.Tensor, seq: Sequence, draft: list[int]) -> list[int]:
    """The tokens a step with `draft` emits: the accepted draft prefix, then one of the target's.

    `logits`: float32 `[len(draft) + 1, vocab]`, row i predicting the token after draft[:i].
    """
    rows = [seq] * logits.shape[0]
    if seq.params.logit_bias:
        logits = logits.clone()
        _apply_logit_bias(logits, rows, list(range(len(rows))))
    if seq.params.greedy:
        # max's indices, as the sampler: the same first maximal index as non-speculative steps.
        target: list[int] = logits.max(dim=1).indices.tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target[accepted]:
            accepted += 1
        return [*draft[:accepted], target[accepted]]
    filtered = _filter(logits, rows)
    if seq.draft_probs is not None:
        return _verify_against(filtered, seq, draft, seq.draft_probs)
    probs = filtered.softmax(dim=1)
    chosen = probs[torch.arange(len(draft)), torch.tensor(draft, dtype=torch.long)].tolist()
    for i, token in enumerate(draft):
        if _uniform(seq, logits.device) < chosen[i]:
            continue
        residual = filtered[i].clone()
        residual[token] = float("-inf")  # p without the rejected token, renormalised
        if not bool(torch.isfinite(residual).any()):  # p(token) was 1 up to rounding
            continue
        return [*draft[:i], int(_draw(residual.unsqueeze(0), [seq])[0])]
    return [*draft, int(_draw(filtered[-1:], [seq])[0])]


def _verify_against(
    filtered: torch.Tensor, seq: Sequence, draft: list[int], q: torch.Tensor
) -> list[int]:
    """Rejection sampling of a sampled draft: token t of row i is accepted with probability
    min(1, p(t) / q(t)); the first rejected one is replaced by a draw from max(0, p - q)."""
    p = filtered.softmax(dim=1)
    index = torch.tensor(draft, dtype=torch.long, device=p.device)
    rows = torch.arange(len(draft), device=p.device)
    p_t = p[rows, index].tolist()
    q_t = q[rows, index.to(q.device)].tolist()
    for i in range(len(draft)):
        if q_t[i] <= 0.0 or _uniform(seq, p.device) * q_t[i] < p_t[i]:
            continue  # u < p/q without dividing (q(t) = 0: min(1, p/0) = 1)
        residual = (p[i] - q[i].to(p.device)).clamp_(min=0.0)
        if not bool((residual > 0).any()):  # p == q up to rounding: nothing to resample
            continue
        return [*draft[:i], int(_draw(residual.log().unsqueeze(0), [seq])[0])]
    return [*draft, int(_draw(filtered[-1:], [seq])[0])]


Sampled = tuple[Sequence, list[int], TokenLogprob | None]  # a sequence's new tokens this step


def sample_step(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled]:
    """Each sampling sequence's new tokens: one sampled token for a sequence without a draft
    (one logits row), the verified draft and a token of the target's for one with a draft
    (1 + len(draft) rows), in the order of `seqs`."""
    plain_rows: list[int] = []
    plain_seqs: list[Sequence] = []
    row = 0
    for seq in seqs:
        if not seq.draft:
            plain_rows.append(row)
            plain_seqs.append(seq)
        row += 1 + len(seq.draft)
    token_ids, logprobs = sampler(logits[plain_rows], plain_seqs) if plain_seqs else ([], [])
    plain = iter(zip(token_ids, logprobs, strict=True))
    out: list[Sampled] = []
    row = 0
    for seq in seqs:
        n = 1 + len(seq.draft)
        if seq.draft:
            out.append((seq, verify(logits[row : row + n], seq, seq.draft), None))
        else:
            token, lp = next(plain)
            out.append((seq, [token], lp))
        row += n
    return out


def draft_length(seq: Sequence, most: int, budget: int, max_model_len: int) -> int:
    """How many tokens a drafter may propose for `seq` this step: k drafts and the bonus
    token, never past `most`, the step's `budget`, max_tokens or the context limit."""
    return min(
        most,
        budget,
        seq.params.max_tokens - seq.num_output_tokens - 1,
        max_model_len - seq.num_tokens - 1,
    )
