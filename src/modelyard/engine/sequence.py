"""`Sequence`: one generated continuation (a request with `n` choices has `n`) and its state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from modelyard.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from modelyard.engine.grammar import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client went away, timeout, or shutdown
    ERROR = "error"  # the engine step holding it failed (the engine went on)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this step, best first


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # the choice index within its request
    prompt_len: int
    token_ids: list[int]  # prompt followed by the generated tokens
    params: SamplingParams
    priority: int = 0  # lower runs first: 0 interactive, 1 batch
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None  # time.monotonic() of its first admission (queue time)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first admission
    admitted: bool = False
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks, in order
    num_registered_blocks: int = 0  # full blocks already published to the prefix cache
    swap_slots: list[int] = field(default_factory=list)  # swapped out: its KV in the swap pool
    leader: Sequence | None = None  # n>1: wait for the first choice's prefill, then share it
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cache_salt: bytes = b""  # a prefix-cache namespace (per tenant): only equal salts share blocks
    grammar: GrammarState | None = None  # the output's matcher when it is constrained
    draft: list[int] = field(default_factory=list)  # speculative tokens this step verifies
    # a draft model's distribution q over each draft token's position (`[len(draft), vocab]`)
    # when the draft was sampled; None: drafted greedily or by prompt lookup (q one-hot)
    draft_probs: torch.Tensor | None = None

    def drop_draft(self) -> None:
        """No draft this step (none proposed, or its step did not run)."""
        self.draft = []
        self.draft_probs = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def prefilling(self) -> bool:
        return self.num_computed_tokens < self.prompt_len

    @property
    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival, self.seq_id)
