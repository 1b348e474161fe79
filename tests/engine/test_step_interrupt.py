"""A step of batch work alone stops between two decoder layers when a real-time request arrives
(`engine/step_interrupt.py`): the stopped step runs again later, and every sequence's greedy
output equals an uninterrupted run's. Steps with a real-time row are never stopped. Both forms
of a step: the modules' layer loop (float32) and the one-call C decode step (w8a8 with VNNI)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from modelyard.config import EngineSettings
from modelyard.engine import cpu_kernels
from modelyard.engine.async_engine import AsyncEngine
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.sampling_params import SamplingParams
from tests.parity import make_engine
from tests.tiny_models import build_model

BATCH, REALTIME = 3, 0
KERNELS = cpu_kernels.load_kernels(EngineSettings().cache_dir)
# (arrival step, request id, prompt, priority, max_tokens)
REQUESTS = [
    (0, "batch-0", list(range(10, 30)), BATCH, 24),
    (0, "batch-1", list(range(40, 47)), BATCH + 1, 24),
    (2, "batch-2", list(range(70, 88)), BATCH, 24),
    (9, "rt-0", list(range(100, 112)), REALTIME, 8),
]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(engine: LLMEngine, before_step: Any = None) -> dict[str, list[int]]:
    """The requests through `engine` step by step, the flag cleared before each step as the
    engine's loop does; `before_step(step)` may then raise it."""
    out: dict[str, list[int]] = {rid: [] for _, rid, *_ in REQUESTS}
    step = 0
    while step <= max(at for at, *_ in REQUESTS) or engine.has_unfinished():
        engine.interrupt.clear()
        for at, rid, prompt, priority, max_tokens in REQUESTS:
            if at == step:
                engine.add_request(rid, prompt, params(max_tokens), priority=priority)
        if before_step is not None:
            before_step(step)
        for o in engine.step():
            assert o.error is None
            out[o.request_id] += [t for d in o.deltas for t in d.token_ids]
        step += 1
        assert step < 1_000, "no progress"
    return out


def stop_every_other_step_inside(engine: LLMEngine) -> None:
    """Raise the flag as the first decoder layer of every other step starts (past the check
    before it, so a stopped step has written that layer's KV slots and stops before the next)."""
    calls = {"n": 0}

    def raise_every_other_time(*_: Any) -> None:
        calls["n"] += 1
        if calls["n"] % 2:
            engine.urgent(REALTIME)

    engine.runner.model.model.layers[0].register_forward_pre_hook(raise_every_other_time)


def test_batch_steps_stopped_mid_step_give_the_uninterrupted_output(tiny_llama: Path) -> None:
    """The flag is raised inside the first decoder layer of every other step, after it wrote
    its KV slots: a step of batch alone stops before the second layer and runs again later; a
    step holding the real-time request runs through."""
    reference = run(make_engine(tiny_llama))
    engine = make_engine(tiny_llama)
    stop_every_other_step_inside(engine)
    got = run(engine)
    assert engine.interrupt.count > 0
    assert got == reference
    assert all(len(got[rid]) == n for _, rid, _, _, n in REQUESTS)
    assert engine.kv.pool.num_free == engine.kv.num_blocks  # every block given back


def test_a_step_with_a_real_time_row_is_never_stopped(tiny_llama: Path) -> None:
    """The flag raised before every step until the real-time request is done: every step of
    batch alone before it arrives stops, every step holding it runs, and all outputs are the
    reference's."""
    reference = run(make_engine(tiny_llama))
    engine = make_engine(tiny_llama)

    def raise_before(step: int) -> None:
        if step < 9 or "rt-0" in engine._requests:
            engine.urgent(REALTIME)

    got = run(engine, raise_before)
    assert got == reference
    assert engine.interrupt.count >= 9  # steps 0-8 held batch alone


def test_batch_priorities_do_not_raise_the_flag(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    engine.urgent(BATCH)
    engine.urgent(BATCH + 5)
    reference = run(make_engine(tiny_llama))
    got = run(engine, lambda step: engine.urgent(BATCH))
    assert got == reference and engine.interrupt.count == 0


def test_the_one_call_c_decode_step_stops_and_reruns(tmp_path: Path, tiny_llama: Path) -> None:
    assert KERNELS is not None
    if not KERNELS.int8_matmul_vectorized:
        pytest.skip("no AVX-512 VNNI here: w8a8 runs FBGEMM's matmul, and steps the modules")
    reference = run(make_engine(tiny_llama, quantization="w8a8"))
    engine = make_engine(tiny_llama, quantization="w8a8")
    got = run(engine, lambda step: step % 2 or engine.urgent(REALTIME))
    assert engine.runner.model.one_call.described is not None  # decode steps were one C call
    assert engine.interrupt.count > 0
    assert got == reference


def test_a_real_time_request_through_the_async_engine_stops_a_batch_step(
    tiny_llama: Path,
) -> None:
    """Through `AsyncEngine`: a real-time request queued while batch work decodes raises the
    flag; the loop clears it before taking requests in (a flag left raised would stop every
    later step of batch alone, and this would never finish); the outputs are the reference's."""
    reference = run(make_engine(tiny_llama))
    engine = make_engine(tiny_llama)
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def main() -> dict[str, list[int]]:
        decoding = asyncio.Event()

        async def collect(rid: str, prompt: list[int], priority: int, n: int) -> list[int]:
            tokens: list[int] = []
            async for o in async_engine.generate(prompt, params(n), rid, priority):
                tokens += [t for d in o.deltas for t in d.token_ids]
                decoding.set()
            return tokens

        batch = [r for r in REQUESTS if r[3] >= BATCH]
        tasks = {rid: asyncio.create_task(collect(rid, p, pr, n)) for _, rid, p, pr, n in batch}
        await decoding.wait()  # the batch is decoding
        _, rid, prompt, priority, n = REQUESTS[-1]
        tasks[rid] = asyncio.create_task(collect(rid, prompt, priority, n))
        return {rid: await t for rid, t in tasks.items()}

    try:
        got = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert got == reference


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_stopped_steps_with_drafts_give_the_uninterrupted_output(
    tiny_llama: Path, tmp_path: Path, speculative: str
) -> None:
    """Drafts proposed for a step that stops are dropped and proposed again with its rerun."""
    reference = run(make_engine(tiny_llama))
    draft = build_model(tmp_path / "draft", "llama", seed=7, num_hidden_layers=1)
    extra = {"speculative_model": str(draft)} if speculative == "draft" else {}
    engine = make_engine(tiny_llama, speculative=speculative, **extra)
    stop_every_other_step_inside(engine)
    got = run(engine)
    assert engine.interrupt.count > 0
    assert got == reference
    if speculative == "draft":
        assert engine.spec_stats.spec_steps > 0  # drafts were verified
