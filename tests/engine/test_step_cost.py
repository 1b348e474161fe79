"""`StepCost` and the scheduler's backfill budget: batch tokens ride beside real-time decodes
only as far as the measured step times allow, and a step of batch work alone is bounded."""

from __future__ import annotations

from modelyard.engine.kv_cache_manager import KVCacheManager
from modelyard.engine.scheduler import Scheduler
from modelyard.engine.step_cost import StepCost
from tests.engine.test_kv_cache import make_seq
from tests.engine.test_scheduler import run_step

BATCH = 3


def measured(curve: dict[int, float], slowdown: float = 0.1, idle: int = 16) -> StepCost:
    cost = StepCost(slowdown, idle_tokens=idle)
    for rows, seconds in curve.items():
        cost.observe(rows, seconds)
    return cost


def test_a_steep_curve_admits_few_backfill_rows_and_a_flat_one_many() -> None:
    steep = measured({1: 0.0075, 2: 0.0080, 3: 0.0090, 4: 0.0107, 8: 0.0130})
    assert steep.backfill_tokens(1) == 1  # 2 rows: 6.7 % slower; 3 rows: 20 %
    assert steep.backfill_tokens(4) == 1  # 5 rows interpolated: 11.3 ms, within 11.8
    flat = measured({1: 0.010, 8: 0.0105, 16: 0.0108})
    assert flat.backfill_tokens(1) == 15  # up to 16 rows measured, within 10 %
    assert measured({1: 0.01}, slowdown=0.0).backfill_tokens(1) == 0


def test_nothing_is_guessed_past_what_was_measured() -> None:
    cost = StepCost()
    assert cost.backfill_tokens(1) == 0  # nothing measured: no backfill beside real-time
    assert cost.backfill_tokens(0) > 10_000  # no real-time work seen: batch keeps the budget
    cost.saw_realtime()
    assert cost.backfill_tokens(0) == 16  # a step of batch alone: up to its idle bound
    cost.observe(1, 0.01)
    assert cost.backfill_tokens(1) == 0  # no size above 1 measured yet
    assert cost.seconds(5) is None


def test_a_one_off_stall_moves_the_average_little() -> None:
    cost = measured({4: 0.010})
    cost.observe(4, 5.0)  # a first step's compile, a page fault storm, a stolen core
    seconds = cost.seconds(4)
    assert seconds is not None and seconds < 0.013
    cost.observe(4, float("nan"))
    cost.observe(0, 1.0)
    assert cost.seconds(4) == seconds


def _running(sched: Scheduler, prompts: list[list[int]], priority: int, first_id: int) -> list:
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = make_seq(prompt, first_id + i)
        seq.priority = priority
        sched.add(seq)
        seqs.append(seq)
    return seqs


def test_backfill_decodes_ride_beside_real_time_only_as_far_as_the_cost_allows() -> None:
    cost = measured({1: 0.0075, 2: 0.0080, 3: 0.0090, 8: 0.0130})
    sched = Scheduler(KVCacheManager(128, 4), 8, 64, step_cost=cost, backfill_priority=BATCH)
    batch = _running(sched, [[i + 1, 2, 3] for i in range(6)], BATCH, 0)
    run_step(sched, sched.schedule())  # the batch prefills (no real-time work yet)
    out = sched.schedule()
    assert sorted(s.seq_id for s, _ in out.scheduled) == [0, 1, 2, 3, 4, 5]  # alone: all
    run_step(sched, out)
    realtime = _running(sched, [[9, 9, 9]], 0, 10)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == [10]  # its prompt: a step of its own
    run_step(sched, out)
    out = sched.schedule()  # its decode takes one batch row along (2 rows: within 10 %)
    assert [s.seq_id for s, _ in out.scheduled] == [10, 0]
    assert not out.preempted and all(s.block_ids for s in batch)  # the others wait, cached
    realtime[0].priority = 1  # a lower real-time tier is real-time all the same
    assert [s.seq_id for s, _ in sched.schedule().scheduled] == [10, 0]


def test_a_step_of_batch_alone_is_bounded_after_real_time_work_and_chunks_batch_prompts() -> None:
    cost = StepCost(idle_tokens=8)
    sched = Scheduler(KVCacheManager(128, 4), 8, 64, step_cost=cost, backfill_priority=BATCH)
    realtime = _running(sched, [[5, 6, 7]], 0, 10)
    run_step(sched, sched.schedule())
    sched.remove(realtime[0])
    _running(sched, [list(range(1, 21))], BATCH, 0)
    assert [n for _, n in sched.schedule().scheduled] == [8]  # a 20-token prompt, 8 at a time


def test_an_engine_serving_batch_alone_keeps_its_whole_budget() -> None:
    cost = StepCost(idle_tokens=8)
    sched = Scheduler(KVCacheManager(128, 4), 8, 64, step_cost=cost, backfill_priority=BATCH)
    _running(sched, [list(range(1, 21))], BATCH, 0)
    assert [n for _, n in sched.schedule().scheduled] == [20]


def test_without_a_backfill_priority_every_sequence_is_real_time() -> None:
    cost = StepCost(idle_tokens=8)
    sched = Scheduler(KVCacheManager(128, 4), 8, 64, step_cost=cost)
    _running(sched, [list(range(1, 21))], BATCH, 0)
    assert [n for _, n in sched.schedule().scheduled] == [20]


def test_batch_refused_under_unbroken_real_time_traffic_still_moves_every_two_seconds() -> None:
    now = [0.0]
    cost = StepCost(idle_tokens=8, clock=lambda: now[0])
    for rows, seconds in {1: 0.0075, 2: 0.0090}.items():  # a second row: 20 % slower
        cost.observe(rows, seconds)
    cost.saw_realtime()
    assert cost.backfill_tokens(1) == 0
    now[0] = 1.9
    assert cost.backfill_tokens(1) == 0
    now[0] = 2.0
    assert cost.backfill_tokens(1) == 8  # refused for 2 s: one step carries it
    now[0] = 2.1
    assert cost.backfill_tokens(1) == 0  # and the wait starts again
    assert cost.backfill_tokens(0) == 8  # a step without real-time work ends a wait
    now[0] = 5.0
    assert cost.backfill_tokens(1) == 0
