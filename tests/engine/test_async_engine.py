"""AsyncEngine: streams, abort on early exit, request and no-progress timeouts, and failures: a
request that breaks a step fails alone, a fatal or repeating failure stops the engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from modelyard.engine.async_engine import AsyncEngine, EngineDeadError, RequestTimeout
from modelyard.engine.faults import MAX_CONSECUTIVE_FAILED_STEPS, RequestFailed
from modelyard.engine.sampling_params import SamplingParams
from tests.parity import make_engine


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def wait_until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(5.0):
        while not predicate():  # noqa: ASYNC110 - polls state owned by another thread
            await asyncio.sleep(0.01)


async def test_concurrent_streams_complete(tiny_llama: Path) -> None:
    engine = AsyncEngine(make_engine(tiny_llama))
    engine.start()
    try:

        async def one(i: int) -> int:
            n = 0
            async for out in engine.generate([5 + i, 6, 7, 8], params(20 + i)):
                n += sum(len(d.token_ids) for d in out.deltas)
            return n

        counts = await asyncio.gather(*(one(i) for i in range(6)))
        assert counts == [20 + i for i in range(6)]
    finally:
        engine.shutdown()


async def test_leaving_the_stream_aborts_and_frees_blocks(tiny_llama: Path) -> None:
    core = make_engine(tiny_llama)
    engine = AsyncEngine(core)
    engine.start()
    try:
        stream = engine.generate(list(range(10, 40)), params(400))
        async for _ in stream:
            break
        await stream.aclose()  # what a disconnecting HTTP client does to the response generator
        await wait_until(lambda: not core.has_unfinished())
        assert core.kv.pool.num_free == core.kv.num_blocks
        assert core.stats.requests_finished.get("abort") == 1
    finally:
        engine.shutdown()


async def test_request_timeout(tiny_llama: Path) -> None:
    core = make_engine(tiny_llama, max_tokens_cap=4096)
    engine = AsyncEngine(core, request_timeout_s=0.3, no_progress_timeout_s=10)
    engine.start()
    try:
        with pytest.raises(RequestTimeout) as info:
            async for _ in engine.generate(list(range(10, 20)), params(480)):
                await asyncio.sleep(0.01)  # a slow consumer: the budget runs out first
        assert info.value.code == "request_timeout"
        await wait_until(lambda: not core.has_unfinished())
        assert core.kv.pool.num_free == core.kv.num_blocks
    finally:
        engine.shutdown()


async def test_no_progress_timeout_when_stuck_waiting(tiny_llama: Path) -> None:
    # Room for one long request only: the second waits without output and times out.
    core = make_engine(tiny_llama, kv_cache_memory=512 * 16 * 32, max_num_seqs=1)
    engine = AsyncEngine(core, request_timeout_s=60, no_progress_timeout_s=0.05)
    engine.start()
    try:
        first = engine.generate(list(range(10, 20)), params(480))
        await first.__anext__()
        with pytest.raises(RequestTimeout) as info:
            async for _ in engine.generate(list(range(30, 40)), params(10)):
                pass
        assert info.value.code == "no_progress_timeout"
        await first.aclose()
    finally:
        engine.shutdown()


# ----- failures: a bad request fails alone; a broken engine stops and says so ------------------


async def collect(engine: AsyncEngine, prompt: list[int], p: SamplingParams) -> int:
    n = 0
    async for out in engine.generate(prompt, p):
        n += sum(len(d.token_ids) for d in out.deltas)
    return n


async def test_a_failing_request_fails_alone_and_the_engine_keeps_serving(
    tiny_llama: Path,
) -> None:
    core = make_engine(tiny_llama)
    engine = AsyncEngine(core)
    deaths: list[str] = []
    engine.on_fatal = deaths.append
    engine.start()
    try:
        # `generate` trusts its caller (the worker checks first): top_k past the vocabulary
        # reaches the sampler, as any request did before admission checked it.
        poison = SamplingParams(max_tokens=5, top_k=100_000)
        results = await asyncio.gather(
            collect(engine, list(range(10, 30)), params(30)),
            collect(engine, list(range(50, 60)), poison),
            collect(engine, list(range(70, 90)), params(30)),
            return_exceptions=True,
        )
        assert results[0] == 30 and results[2] == 30
        assert isinstance(results[1], RequestFailed)
        assert engine.healthy and not deaths
        assert await collect(engine, [5, 6, 7], params(8)) == 8
        assert core.kv.pool.num_free == core.kv.num_blocks
    finally:
        engine.shutdown()


async def test_a_fatal_error_stops_the_engine_and_calls_on_fatal(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = make_engine(tiny_llama)
    engine = AsyncEngine(core)
    deaths: list[str] = []
    engine.on_fatal = deaths.append
    engine.start()
    try:
        assert await collect(engine, [5, 6, 7], params(4)) == 4

        def out_of_memory(inputs: object) -> None:
            raise MemoryError("injected")

        monkeypatch.setattr(core.runner, "execute", out_of_memory)
        with pytest.raises(EngineDeadError):
            await collect(engine, [5, 6, 7], params(4))
        await wait_until(lambda: bool(deaths))
        assert not engine.healthy and isinstance(engine.error, MemoryError)
        with pytest.raises(EngineDeadError, match="not running"):
            await collect(engine, [5, 6, 7], params(4))
    finally:
        engine.shutdown()


async def test_steps_that_keep_failing_stop_the_engine(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = make_engine(tiny_llama)
    engine = AsyncEngine(core)
    deaths: list[str] = []
    engine.on_fatal = deaths.append
    engine.start()
    try:

        def broken(inputs: object) -> None:
            raise RuntimeError("injected: the model is broken for everyone")

        monkeypatch.setattr(core.runner, "execute", broken)
        for _ in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
            with pytest.raises(RequestFailed):
                await collect(engine, [5, 6, 7], params(4))
            assert engine.healthy
        with pytest.raises(EngineDeadError):
            await collect(engine, [5, 6, 7], params(4))
        await wait_until(lambda: bool(deaths))
        assert "in a row" in deaths[0] and not engine.healthy
    finally:
        engine.shutdown()
