"""Request bookkeeping: one request's sequences and detokenizers, and what it reports per step.

`EngineRequest` builds the `n` sequences of a request (the first one leads: the others reuse
its prompt blocks) and turns what they gained since the last report into a `RequestOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelyard.engine.detokenizer import IncrementalDetokenizer
from modelyard.engine.faults import RequestFailed
from modelyard.engine.sampling_params import SamplingParams
from modelyard.engine.sequence import FinishReason, Sequence, TokenLogprob
from modelyard.engine.tokenizer import Tokenizer


@dataclass
class SequenceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None


@dataclass
class RequestOutput:
    request_id: str
    deltas: list[SequenceDelta]
    finished: bool
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: RequestFailed | None = None  # the request failed in this step (finished is True)
    # time.monotonic() of the request's arrival and of its first admission to a batch (None:
    # still waiting): the worker's queue and prefill time histograms.
    arrival: float = 0.0
    first_scheduled: float | None = None


@dataclass
class EngineRequest:
    request_id: str
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    emitted_tokens: list[int]  # per sequence: generated tokens already reported
    emitted_logprobs: list[int]
    reported_finish: list[bool]

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        device: torch.device,
        first_seq_id: int,
        priority: int,
        arrival: float,
        cache_salt: bytes,
    ) -> EngineRequest:
        """The request's `params.n` sequences, with ids from `first_seq_id` on."""
        seqs: list[Sequence] = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                # Choice i samples from seed + i, so choices differ yet each is reproducible.
                generator = torch.Generator(device=device)
                generator.manual_seed(params.seed + index)
            seqs.append(
                Sequence(
                    seq_id=first_seq_id + index,
                    request_id=request_id,
                    index=index,
                    prompt_len=len(prompt_token_ids),
                    token_ids=list(prompt_token_ids),
                    params=params,
                    priority=priority,
                    arrival=arrival,
                    leader=seqs[0] if seqs else None,
                    generator=generator,
                    cache_salt=cache_salt,
                )
            )
        detoks = [
            IncrementalDetokenizer(
                tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens
            )
            for _ in seqs
        ]
        n = len(seqs)
        return cls(request_id, seqs, detoks, [0] * n, [0] * n, [False] * n)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def take_deltas(self) -> list[SequenceDelta]:
        """What each sequence gained since the last report (a finished one reports once)."""
        deltas: list[SequenceDelta] = []
        for i, seq in enumerate(self.seqs):
            if self.reported_finish[i]:
                continue
            new_tokens = seq.output_token_ids[self.emitted_tokens[i] :]
            if not new_tokens and not seq.finished:
                continue
            deltas.append(
                SequenceDelta(
                    index=seq.index,
                    text=self.detoks[i].take_delta(final=seq.finished),
                    token_ids=new_tokens,
                    logprobs=seq.logprobs[self.emitted_logprobs[i] :],
                    finish_reason=seq.finish_reason,
                )
            )
            self.emitted_tokens[i] += len(new_tokens)
            self.emitted_logprobs[i] = len(seq.logprobs)
            self.reported_finish[i] = seq.finished
        return deltas

    def output(
        self, deltas: list[SequenceDelta], finished: bool, error: RequestFailed | None = None
    ) -> RequestOutput:
        leader = self.seqs[0]
        return RequestOutput(
            request_id=self.request_id,
            deltas=deltas,
            finished=finished,
            prompt_tokens=leader.prompt_len,
            cached_tokens=leader.num_cached_tokens,
            completion_tokens=sum(s.num_output_tokens for s in self.seqs),
            error=error,
            arrival=leader.arrival,
            first_scheduled=leader.first_scheduled,
        )
