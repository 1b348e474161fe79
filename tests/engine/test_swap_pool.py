"""KV swap pool and preemption by swap, without a model: the scheduler over a fake KV cache whose
slot for position p of a sequence holds a value made of p and the token there, written when a
step "computes" it. A sequence's computed slots must hold exactly those values whenever it is
scheduled: after a swap-out and swap-in, after recompute, shared prefix blocks or not."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modelyard.engine.kv_cache_manager import KVCacheManager
from modelyard.engine.preemption import PreemptionCosts, PreemptionMode, Preemptor
from modelyard.engine.scheduler import Scheduler, SchedulerOutput
from modelyard.engine.sequence import Sequence
from modelyard.engine.swap_pool import KVSwapPool, NoSwapSpaceError
from tests.engine.test_kv_cache import make_seq

BS = 4  # tokens per block
SWAP, RECOMPUTE = PreemptionMode.SWAP, PreemptionMode.RECOMPUTE


def caches(num_blocks: int, layers: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(2, num_blocks * BS, 1, 2) for _ in range(layers)]


def value(seq: Sequence, pos: int) -> float:
    return float(pos * 1000 + seq.token_ids[pos])


def slot(seq: Sequence, pos: int) -> int:
    return seq.block_ids[pos // BS] * BS + pos % BS


def check_cache(kv_caches: list[torch.Tensor], out: SchedulerOutput) -> None:
    """Every scheduled sequence finds its computed tokens' K/V where its block table says."""
    for seq, _ in out.scheduled:
        for pos in range(seq.num_computed_tokens):
            for layer in kv_caches:
                assert layer[:, slot(seq, pos)].eq(value(seq, pos)).all(), (seq.seq_id, pos)


def run_step(sched: Scheduler, kv_caches: list[torch.Tensor], out: SchedulerOutput) -> None:
    """Pretend the model ran: write each new token's K/V, count it, sample token 7 at the end."""
    for seq, n in out.scheduled:
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            for layer in kv_caches:
                layer[:, slot(seq, pos)] = value(seq, pos)
        seq.num_computed_tokens += n
        sched.kv.commit(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def swap_scheduler(
    num_blocks: int, pool_blocks: int, policy: str = "swap", max_seqs: int = 8, budget: int = 64
) -> tuple[Scheduler, list[torch.Tensor]]:
    kv_caches = caches(num_blocks)
    kv = KVCacheManager(num_blocks, BS)
    pool = KVSwapPool(kv_caches, pool_blocks, BS) if pool_blocks else None
    preemptor = Preemptor(kv, pool, policy)  # type: ignore[arg-type]
    return Scheduler(kv, max_seqs, budget, preemptor), kv_caches


def test_pool_copies_blocks_out_and_back_into_other_blocks() -> None:
    kv_caches = [torch.randn(2, 8 * BS, 2, 3) for _ in range(3)]
    pool = KVSwapPool(kv_caches, 4, BS)
    assert pool.bytes_per_block == 3 * 2 * BS * 2 * 3 * 4
    before = [c.view(2, 8, BS, 2, 3)[:, [5, 2]].clone() for c in kv_caches]
    slots = pool.swap_out([5, 2])
    assert pool.num_used == 2 and pool.swapped_out_blocks == 2
    for c in kv_caches:
        c.zero_()
    pool.swap_in(slots, [0, 7])
    for c, b in zip(kv_caches, before, strict=True):
        assert torch.equal(c.view(2, 8, BS, 2, 3)[:, [0, 7]], b)
    assert pool.num_free == 4 and pool.swapped_in_blocks == 2
    with pytest.raises(NoSwapSpaceError):
        pool.swap_out([0, 1, 2, 3, 4])
    assert pool.num_free == 4  # a refused swap takes nothing


def test_cost_model_swaps_long_sequences_and_recomputes_short_ones() -> None:
    kv = KVCacheManager(16, BS)
    pool = KVSwapPool(caches(16), 8, BS)
    costs = PreemptionCosts(swap_overhead_s=1e-3, swap_s_per_block=1e-5)
    costs.observe_step(40, 40, 40 * 1e-4)  # a prefill at 10,000 tokens/s
    assert costs.prefill_timed and costs.prefill_s_per_token == pytest.approx(1e-4)
    costs.observe_step(32, 0, 1.0)  # decodes are not prefill: not timed
    assert costs.prefill_s_per_token == pytest.approx(1e-4)
    auto = Preemptor(kv, pool, "auto", costs)
    short, long = make_seq([1] * 6), make_seq([2] * 20, 1)
    short.num_computed_tokens, long.num_computed_tokens = 6, 20
    assert auto.choose(short) is RECOMPUTE  # 0.6 ms to recompute < 1 ms to swap
    assert auto.choose(long) is SWAP  # 2 ms to recompute > 1.05 ms to swap
    long.num_computed_tokens = 40  # 10 blocks: more than the pool's 8
    assert auto.choose(long) is RECOMPUTE
    assert Preemptor(kv, pool, "swap", costs).choose(short) is SWAP
    assert Preemptor(kv, None, "swap").choose(short) is RECOMPUTE  # no pool
    assert PreemptionCosts.measure(pool).swap_seconds(4) > 0  # measured on this machine


def test_interactive_displaces_batch_by_swap_and_batch_resumes_where_it_was() -> None:
    sched, kv_caches = swap_scheduler(num_blocks=6, pool_blocks=8, max_seqs=8)
    batch = make_seq(list(range(1, 10)), 0)  # 9 tokens: 3 blocks
    batch.priority = 3
    sched.add(batch)
    for _ in range(3):
        run_step(sched, kv_caches, sched.schedule())
    assert batch.num_computed_tokens == 11 and len(batch.block_ids) == 3
    interactive = make_seq(list(range(20, 33)), 1)  # 13 tokens: 4 blocks, 3 + 4 > 6
    sched.add(interactive)
    out = sched.schedule()
    assert out.preempted == [batch] and [s for s, _ in out.scheduled] == [interactive]
    assert batch.swap_slots and not batch.block_ids and batch.num_computed_tokens == 11
    assert sched.preemptor.counts == {(3, SWAP): 1}
    run_step(sched, kv_caches, out)
    sched.remove(interactive)  # it finished
    out = sched.schedule()
    assert out.scheduled == [(batch, 1)]  # one decode: nothing recomputed
    assert not batch.swap_slots and sched.preemptor.pool is not None
    assert sched.preemptor.pool.num_free == 8 and sched.preemptor.pool.swapped_in_blocks == 3
    check_cache(kv_caches, out)


def test_full_pool_falls_back_to_recompute() -> None:
    sched, kv_caches = swap_scheduler(num_blocks=6, pool_blocks=2)
    batch = make_seq(list(range(1, 10)), 0)
    batch.priority = 3
    sched.add(batch)
    run_step(sched, kv_caches, sched.schedule())
    sched.add(make_seq(list(range(20, 33)), 1))
    out = sched.schedule()
    assert out.preempted == [batch] and not batch.swap_slots
    assert batch.num_computed_tokens == 0 and sched.preemptor.counts == {(3, RECOMPUTE): 1}


def test_a_swapped_sequence_that_is_aborted_gives_its_pool_blocks_back() -> None:
    sched, kv_caches = swap_scheduler(num_blocks=6, pool_blocks=8)
    batch = make_seq(list(range(1, 10)), 0)
    batch.priority = 3
    sched.add(batch)
    run_step(sched, kv_caches, sched.schedule())
    sched.add(make_seq(list(range(20, 33)), 1))
    sched.schedule()
    assert batch.swap_slots
    sched.remove(batch)
    assert not batch.swap_slots and sched.preemptor.pool is not None
    assert sched.preemptor.pool.num_free == 8


def test_a_step_preempting_for_its_own_decodes_swaps_the_latest_sequence() -> None:
    sched, kv_caches = swap_scheduler(num_blocks=3, pool_blocks=8)
    a, b = make_seq([1, 2, 3], 0), make_seq([4, 5, 6], 1)
    sched.add(a)
    sched.add(b)
    for _ in range(2):
        run_step(sched, kv_caches, sched.schedule())
    out = sched.schedule()  # position 4 needs a second block each: b makes room
    assert out.preempted == [b] and b.swap_slots and b.num_computed_tokens == 4
    run_step(sched, kv_caches, out)
    sched.remove(a)
    out = sched.schedule()
    assert out.scheduled == [(b, 1)]
    check_cache(kv_caches, out)


arrivals = st.lists(
    st.tuples(
        st.integers(0, 6),  # the step it arrives at
        st.sampled_from([0, 1, 3, 4]),  # priority: real-time tiers 0-1, batch 3-4
        st.integers(1, 14),  # prompt length
        st.integers(1, 12),  # tokens to generate: at most 7 blocks with its prompt
        st.integers(0, 2),  # prompt family: equal families share prefix-cache blocks
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=60, deadline=None)
@given(arrivals, st.sampled_from(["swap", "recompute", "auto"]), st.integers(0, 12))
def test_preemption_keeps_every_cache_right_and_takes_the_least_urgent(
    reqs: list[tuple[int, int, int, int, int]], policy: str, pool_blocks: int
) -> None:
    sched, kv_caches = swap_scheduler(8, pool_blocks, policy, max_seqs=4, budget=16)
    seqs: list[tuple[int, Sequence, int]] = []
    for i, (at, priority, length, gen, family) in enumerate(sorted(reqs)):
        seq = make_seq([100 * family + t for t in range(length)], i)
        seq.priority = priority
        seqs.append((at, seq, gen))
    for step in range(400):
        for at, seq, _ in seqs:
            if at == step:
                sched.add(seq)
        out = sched.schedule()
        check_cache(kv_caches, out)
        holding = [s.priority for s in sched.running]
        for victim in out.preempted:  # the least urgent go first: nobody less urgent stays
            assert all(p <= victim.priority for p in holding)
            assert all(s.priority <= victim.priority for s, _ in out.scheduled)
        run_step(sched, kv_caches, out)
        for _, seq, gen in seqs:
            if not seq.finished and seq.num_output_tokens >= gen:
                sched.remove(seq)
        if step > 8 and all(s.finished for _, s, _ in seqs):
            break
    assert all(s.finished for _, s, _ in seqs)
    assert sched.kv.pool.num_free == sched.kv.num_blocks
    pool = sched.preemptor.pool
    assert pool is None or pool.num_free == pool.num_blocks
    assert sum(sched.preemptor.counts.values()) == sched.num_preemptions
