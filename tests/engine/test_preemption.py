"""Priority preemption on a tiny model: batch sequences displaced by real-time ones, by swap and by
recompute, give the greedy output of an uninterrupted run, stepped and streamed; real-time ones
are never preempted for batch; the counters say what happened."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from modelyard.engine.async_engine import AsyncEngine
from modelyard.engine.client import LocalEngineClient
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.preemption import MAX_CACHES, make_preemptor
from modelyard.engine.sampling_params import SamplingParams
from modelyard.worker.metrics import WorkerMetrics
from tests.parity import make_engine

BATCH, REALTIME = 3, 0  # the gateway's priorities: batch items from 3, real-time tiers 0-2
TOKEN_BYTES = 512  # tiny_llama: 2 layers * 2 (K, V) * 2 kv heads * 16 dims * 4 bytes
# (arrival step, request id, prompt, priority, max_tokens)
REQUESTS = [
    (0, "batch-0", list(range(10, 30)), BATCH, 40),
    (0, "batch-1", list(range(40, 62)), BATCH + 1, 40),
    (1, "batch-2", list(range(70, 88)), BATCH, 40),
    (6, "rt-0", list(range(100, 124)), REALTIME, 16),
    (9, "rt-1", list(range(130, 150)), REALTIME + 1, 16),
]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def small_engine(folder: Path, mode: str, swap_blocks: int = 64) -> LLMEngine:
    # 32 blocks of 4 tokens: the three batch sequences (~60 tokens each at the end) cannot all
    # stay, and the real-time ones need room taken from them.
    return make_engine(
        folder,
        block_size=4,
        kv_cache_memory=TOKEN_BYTES * 4 * 32,
        kv_swap_memory=TOKEN_BYTES * 4 * swap_blocks,
        preemption_mode=mode,
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama: Path) -> dict[str, list[int]]:
    """Each request alone in a roomy engine: nothing is ever preempted."""
    engine = make_engine(tiny_llama, block_size=4, preemption_mode="recompute")
    out: dict[str, list[int]] = {}
    for _, rid, prompt, _, max_tokens in REQUESTS:
        engine.add_request(rid, prompt, params(max_tokens))
        tokens: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens += [t for d in o.deltas for t in d.token_ids]
        out[rid] = tokens
    assert engine.scheduler.num_preemptions == 0
    return out


def run_stepped(engine: LLMEngine) -> dict[str, list[int]]:
    results: dict[str, list[int]] = {rid: [] for _, rid, *_ in REQUESTS}
    step = 0
    while step <= max(at for at, *_ in REQUESTS) or engine.has_unfinished():
        for at, rid, prompt, priority, max_tokens in REQUESTS:
            if at == step:
                engine.add_request(rid, prompt, params(max_tokens), priority=priority)
        for o in engine.step():
            assert o.error is None
            results[o.request_id] += [t for d in o.deltas for t in d.token_ids]
        step += 1
        assert step < 2_000, "no progress"
    return results


def assert_all_given_back(engine: LLMEngine) -> None:
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    pool = engine.preemptor.pool
    assert pool is None or (pool.num_free == pool.num_blocks and not pool.num_used)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_batch_resumes_with_the_uninterrupted_output(
    tiny_llama: Path, uninterrupted: dict[str, list[int]], mode: str
) -> None:
    engine = small_engine(tiny_llama, mode)
    assert run_stepped(engine) == uninterrupted
    counts = engine.preemptor.counts
    assert counts and {str(m) for _, m in counts} == {mode}
    assert all(priority >= BATCH for priority, _ in counts)  # real-time never preempted
    pool = engine.preemptor.pool
    if mode == "swap":
        assert pool is not None and pool.swapped_out_blocks == pool.swapped_in_blocks > 0
    else:
        assert pool is None
    assert_all_given_back(engine)


def test_a_full_swap_pool_falls_back_to_recompute(
    tiny_llama: Path, uninterrupted: dict[str, list[int]]
) -> None:
    engine = small_engine(tiny_llama, "swap", swap_blocks=8)
    assert run_stepped(engine) == uninterrupted
    modes = {str(m) for _, m in engine.preemptor.counts}
    assert modes == {"swap", "recompute"}
    assert_all_given_back(engine)


def test_auto_mode_and_its_metrics(tiny_llama: Path, uninterrupted: dict[str, list[int]]) -> None:
    engine = small_engine(tiny_llama, "auto")
    assert engine.preemptor.costs.swap_seconds(1) > 0  # measured when the pool was made
    assert run_stepped(engine) == uninterrupted
    assert engine.preemptor.costs.prefill_timed
    client = LocalEngineClient(AsyncEngine(engine))
    snap = client.snapshot()
    assert sum(snap.preemptions_by.values()) == snap.preemptions > 0
    assert all(p >= BATCH and m in ("swap", "recompute") for p, m in snap.preemptions_by)
    assert snap.kv_swap_capacity_blocks == 64 and snap.kv_swap_used_blocks == 0
    assert snap.kv_swapped_out_blocks == snap.kv_swapped_in_blocks
    text = WorkerMetrics(client, "tiny").render().decode()
    for (priority, mode), count in snap.preemptions_by.items():
        labels = f'mode="{mode}",model="tiny",priority="{priority}"'
        assert f"modelyard_preemptions_total{{{labels}}} {float(count)}" in text
    assert 'modelyard_kv_swap_capacity_blocks{model="tiny"} 64.0' in text
    out = f'modelyard_kv_swapped_out_blocks_total{{model="tiny"}} {snap.kv_swapped_out_blocks}.0'
    assert out in text and "modelyard_kv_swapped_in_blocks_total" in text


def test_a_deploys_swap_pool_is_bounded_by_its_cache(tiny_llama: Path) -> None:
    engine = make_engine(
        tiny_llama, block_size=4, kv_cache_memory=TOKEN_BYTES * 4 * 32, kv_swap_memory=2**40,
        preemption_mode="swap",
    )  # fmt: skip
    assert engine.preemptor.pool is not None
    assert engine.preemptor.pool.num_blocks == MAX_CACHES * engine.kv.num_blocks


def test_no_swap_memory_means_recompute(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, kv_swap_memory=0, preemption_mode="swap")
    assert engine.preemptor.pool is None


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_streamed_outputs_equal_uninterrupted_ones(
    tiny_llama: Path, uninterrupted: dict[str, list[int]], mode: str
) -> None:
    # Three batch streams fill max_num_seqs; each real-time stream that arrives takes the slot
    # of one of them, which resumes when a slot frees.
    core = make_engine(tiny_llama, block_size=4, preemption_mode=mode, max_num_seqs=3)
    engine = AsyncEngine(core)
    engine.start()
    started = {rid: asyncio.Event() for _, rid, *_ in REQUESTS}

    async def stream(rid: str, prompt: list[int], priority: int, max_tokens: int) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompt, params(max_tokens), rid, priority):
            tokens += [t for d in out.deltas for t in d.token_ids]
            started[rid].set()
        return tokens

    try:
        batch = [r for r in REQUESTS if r[3] >= BATCH]
        tasks = {r[1]: asyncio.create_task(stream(*r[1:])) for r in batch}
        async with asyncio.timeout(30):
            await asyncio.gather(*(started[r[1]].wait() for r in batch))
            for r in REQUESTS:
                if r[3] < BATCH:
                    tasks[r[1]] = asyncio.create_task(stream(*r[1:]))
            results = {rid: await task for rid, task in tasks.items()}
    finally:
        engine.shutdown()
    assert results == uninterrupted
    counts = core.preemptor.counts
    assert counts and {str(m) for _, m in counts} == {mode}
    assert all(priority >= BATCH for priority, _ in counts)
    assert_all_given_back(core)


def test_tensor_parallelism_recomputes_and_refuses_swap(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    auto = make_preemptor(engine.kv, engine.runner.kv_caches, "auto", 2**20, tensor_parallel=True)
    assert auto.pool is None  # helper ranks hold KV this process cannot copy
    with pytest.raises(ValueError, match="preemption_mode=swap"):
        make_engine(
            tiny_llama,
            tensor_parallel_size=2,
            preemption_mode="swap",
            num_threads=torch.get_num_threads(),
        )
