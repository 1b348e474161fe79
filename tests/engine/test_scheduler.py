"""Scheduler: token budget, chunked prefill, priorities, max_num_seqs and preemption."""

from __future__ import annotations

from modelyard.engine.kv_cache_manager import KVCacheManager
from modelyard.engine.scheduler import Scheduler, SchedulerOutput
from modelyard.engine.sequence import SequenceStatus
from tests.engine.test_kv_cache import make_seq


def run_step(sched: Scheduler, out: SchedulerOutput, next_token: int = 7) -> None:
    """Pretend the model ran: count computed tokens and append a token where one is sampled."""
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        sched.kv.commit(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(next_token)


def test_budget_is_shared_and_long_prompts_are_chunked() -> None:
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    a, b = make_seq(list(range(1, 11)), 0), make_seq(list(range(20, 40)), 1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 10), (1, 6)]
    assert out.num_batched_tokens == 16
    run_step(sched, out)
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0  # b has not finished its prompt
    out = sched.schedule()
    # a decodes one token; b continues its prompt with the rest of the budget.
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 14)]


def test_priority_orders_admission() -> None:
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64)
    batch = make_seq([1, 2, 3], 0)
    batch.priority = 1
    interactive = make_seq([4, 5, 6], 1)
    sched.add(batch)
    sched.add(interactive)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == [1]
    assert batch.status is SequenceStatus.WAITING


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        sched.add(make_seq([i + 1, 2, 3], i))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_preemption_frees_blocks_and_recomputes_later() -> None:
    # 4 blocks of 2 tokens: two 3-token prompts take 2 blocks each; growing needs a fifth.
    kv = KVCacheManager(4, 2, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seq([1, 2, 3], 0), make_seq([4, 5, 6], 1)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())
    run_step(sched, sched.schedule())  # positions 3 fit in the second blocks
    out = sched.schedule()  # position 4 needs a new block for each: only one can have it
    assert [s.seq_id for s, _ in out.scheduled] == [0]
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_ids
    assert b.num_output_tokens == 2  # its generated tokens are kept and will be recomputed
    sched.remove(a)  # a finishes
    out = sched.schedule()
    assert out.scheduled == [(b, b.num_tokens)]  # prompt + outputs recomputed in one go


def test_waiting_sequence_that_does_not_fit_blocks_the_queue_without_crashing() -> None:
    kv = KVCacheManager(2, 4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    big = make_seq(list(range(1, 8)), 0)
    small = make_seq([9], 1)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == [0]
    out2 = sched.schedule()  # big runs; small waits for blocks (strict order, no overtaking)
    assert [s.seq_id for s, _ in out2.scheduled] == [0]
    assert small.status is SequenceStatus.WAITING


def test_siblings_wait_for_the_leader_prefill_and_reuse_it() -> None:
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = list(range(1, 14))
    leader = make_seq(prompt, 0)
    sibling = make_seq(prompt, 1)
    sibling.leader = leader
    sched.add(leader)
    sched.add(sibling)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == [0]
    run_step(sched, out)
    out = sched.schedule()
    assert (sibling, 1) in out.scheduled  # 12 of 13 prompt tokens came from the cache
    assert sibling.num_cached_tokens == 12


def test_interactive_prefill_runs_without_batch_decodes_in_its_step() -> None:
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    batch = [make_seq([i + 1, 2, 3], i) for i in range(3)]
    for s in batch:
        s.priority = 1
        sched.add(s)
    run_step(sched, sched.schedule())  # the batch prefills
    out = sched.schedule()
    assert sorted(s.seq_id for s, _ in out.scheduled) == [0, 1, 2]  # batch decodes alone
    run_step(sched, out)
    interactive = make_seq([9, 9, 9, 9, 9], 10)
    sched.add(interactive)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == [10]  # its prefill step is its own
    assert not out.preempted and all(s.block_ids for s in batch)  # batch kept its cache
    run_step(sched, out)
    out = sched.schedule()  # prompt done: decodes mix again, interactive first
    assert [s.seq_id for s, _ in out.scheduled] == [10, 0, 1, 2]


def test_interactive_takes_room_from_batch_when_full() -> None:
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    batch = [make_seq([i + 1, 2, 3], i) for i in range(2)]
    for s in batch:
        s.priority = 1
        sched.add(s)
    run_step(sched, sched.schedule())
    interactive = make_seq([9, 9, 9], 10)
    sched.add(interactive)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == [10]
    assert out.preempted == [batch[1]]  # the latest batch sequence made room
    assert batch[1].status is SequenceStatus.WAITING and not batch[1].block_ids
    assert batch[0].block_ids  # the other one kept its place
