"""`Preemptor`: how a running sequence gives its KV blocks up to a more urgent one, and comes back.

Two ways (vLLM's preemption modes): *swap* copies the sequence's computed blocks into the
host-memory `KVSwapPool` and copies them back into fresh blocks when it resumes, so it goes on
where it stopped; *recompute* drops them and computes the prompt and the tokens generated so far
again when it resumes. Either way the output is the one an uninterrupted run gives.

The `preemption_mode` setting picks: `recompute`, `swap` (recompute when the pool has no room
for the victim), or `auto`, which swaps when `PreemptionCosts` says the two copies cost less
than recomputing that many tokens and the pool has room. The copy's cost (a fixed part and a
part per block) is measured once when the pool is made; the recompute's (seconds per token) is
measured on the engine's prefill-heavy steps, assumed 10,000 tokens/s until the first one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

import torch

from modelyard.engine.kv_cache_manager import KVCacheManager, blocks_for
from modelyard.engine.sequence import Sequence
from modelyard.engine.swap_pool import KVSwapPool

PreemptionPolicy = Literal["auto", "swap", "recompute"]

DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
MIN_TIMED_PREFILL_TOKENS = 16  # shorter steps time their overheads more than their tokens


class PreemptionMode(enum.StrEnum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass
class PreemptionCosts:
    """The engine's own cost model: seconds to bring a preempted sequence back either way."""

    swap_overhead_s: float = 0.0  # one swap's fixed cost, out and in
    swap_s_per_block: float = 0.0  # and its cost per block, out and in
    prefill_s_per_token: float = 1.0 / DEFAULT_PREFILL_TOKENS_PER_S
    prefill_timed: bool = False

    @classmethod
    def measure(cls, pool: KVSwapPool, blocks: int = 16, tries: int = 3) -> PreemptionCosts:
        """Time swaps of one and of `blocks` blocks (the best of `tries`) on the pool."""
        one = min(pool.time_copy(1) for _ in range(tries))
        many_blocks = max(2, min(blocks, pool.num_blocks))
        many = min(pool.time_copy(many_blocks) for _ in range(tries))
        per_block = max(many - one, 0.0) / (many_blocks - 1)
        return cls(swap_overhead_s=max(one - per_block, 0.0), swap_s_per_block=per_block)

    def swap_seconds(self, num_blocks: int) -> float:
        return self.swap_overhead_s + num_blocks * self.swap_s_per_block

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_s_per_token

    def observe_step(self, num_tokens: int, prefill: int, seconds: float) -> None:
        """A model step computing `num_tokens` tokens, `prefill` of them in prompt chunks, took
        `seconds`: timed as a prefill when at least half its tokens are."""
        if num_tokens < MIN_TIMED_PREFILL_TOKENS or 2 * prefill < num_tokens or seconds <= 0:
            return
        per_token = seconds / num_tokens
        if not self.prefill_timed:
            self.prefill_s_per_token, self.prefill_timed = per_token, True
        else:  # a moving average: one odd step moves it little
            self.prefill_s_per_token += 0.2 * (per_token - self.prefill_s_per_token)


@dataclass
class Preemptor:
    kv: KVCacheManager
    pool: KVSwapPool | None = None  # None: no swap space, always recompute
    policy: PreemptionPolicy = "recompute"
    costs: PreemptionCosts = field(default_factory=PreemptionCosts)
    counts: dict[tuple[int, PreemptionMode], int] = field(default_factory=dict)  # by priority

    @property
    def num_preemptions(self) -> int:
        return sum(self.counts.values())

    def choose(self, seq: Sequence) -> PreemptionMode:
        """Swap or recompute this sequence, by policy, room in the pool and cost."""
        blocks = blocks_for(seq.num_computed_tokens, self.kv.block_size)
        if self.policy == "recompute" or self.pool is None or not blocks:
            return PreemptionMode.RECOMPUTE
        if blocks > self.pool.num_free:
            return PreemptionMode.RECOMPUTE
        if self.policy == "auto":
            swap = self.costs.swap_seconds(blocks)
            if swap >= self.costs.recompute_seconds(seq.num_computed_tokens):
                return PreemptionMode.RECOMPUTE
        return PreemptionMode.SWAP

    def preempt(self, seq: Sequence) -> PreemptionMode:
        """Free the sequence's blocks; by swap its computed tokens survive in the pool."""
        mode = self.choose(seq)
        if mode is PreemptionMode.SWAP and self.pool is not None:
            blocks = blocks_for(seq.num_computed_tokens, self.kv.block_size)
            seq.swap_slots = self.pool.swap_out(seq.block_ids[:blocks])
        else:
            seq.num_computed_tokens = 0
        self.kv.free(seq)
        key = (seq.priority, mode)
        self.counts[key] = self.counts.get(key, 0) + 1
        return mode

    def resume(self, seq: Sequence) -> None:
        """A swapped sequence got its blocks again: copy its computed tokens back into them."""
        if seq.swap_slots and self.pool is not None:
            self.pool.swap_in(seq.swap_slots, seq.block_ids[: len(seq.swap_slots)])
            seq.swap_slots = []

    def discard(self, seq: Sequence) -> None:
        """The sequence is gone (finished, aborted, failed): free what it holds in the pool."""
        if seq.swap_slots and self.pool is not None:
            self.pool.release(seq.swap_slots)
        seq.swap_slots = []


MAX_CACHES = 4  # the swap pool holds at most this many KV caches' blocks


def make_preemptor(
    kv: KVCacheManager,
    kv_caches: list[torch.Tensor],
    policy: PreemptionPolicy,
    swap_memory: int,
    tensor_parallel: bool = False,
) -> Preemptor:
    """The engine's preemptor: a swap pool of `swap_memory` bytes unless the policy is
    `recompute`, the budget holds no block, or the cache is split over tensor-parallel ranks
    (whose helper ranks hold KV this process cannot copy); then it always recomputes."""
    if policy == "recompute" or tensor_parallel or not kv_caches:
        return Preemptor(kv, None, policy)
    layer = kv_caches[0]
    bytes_per_block = 2 * kv.block_size * layer[0, 0].numel() * layer.element_size()
    # A deploy's setting is bounded here: more than a few caches' worth of preempted blocks
    # only holds host memory (pinned, on CUDA) the node's other replicas need.
    by_setting = swap_memory // (bytes_per_block * len(kv_caches))
    num_blocks = min(by_setting, MAX_CACHES * kv.num_blocks)
    if num_blocks < 1:
        return Preemptor(kv, None, policy)
    pool = KVSwapPool(kv_caches, num_blocks, kv.block_size)
    costs = PreemptionCosts.measure(pool) if policy == "auto" else PreemptionCosts()
    return Preemptor(kv, pool, policy, costs)
