"""Tensor parallelism: 2 ranks on CPU (gloo) against transformers and the single-device engine,
the step's wire format, the divisibility error, rank failures, and a real
`modelyard worker --tensor-parallel-size 2` serving the OpenAI API."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.model_runner import StepInputs
from modelyard.engine.models.config import UnsupportedModelError
from modelyard.engine.models.loader import read_model_config
from modelyard.engine.models.sharding import check_tensor_parallel
from modelyard.engine.sampling_params import SamplingParams
from modelyard.engine.tensor_parallel.wire import TensorParallelError, pack_step, unpack_step
from tests.conftest import WorkerProcess
from tests.engine.test_model_parity import prompts
from tests.parity import hf_greedy, hf_logits, make_engine, record_logits, run_staggered
from tests.tiny_models import build_model

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),  # 4 heads, 2 KV heads (GQA): one KV head and 2 query heads a rank
    "llama-tied": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "qwen2": ("qwen2", {}),  # q/k/v biases shard with their rows
    "qwen3": ("qwen3", {"head_dim": 32}),  # per-head q/k norms
}


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """Rank 0 takes its share of the cores (torch.set_num_threads); give them back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="class", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, overrides = VARIANTS[request.param]
    return build_model(tmp_path_factory.mktemp(request.param) / "m", model_type, **overrides)


@pytest.fixture(scope="class")
def tp_engine(variant: Path) -> Iterator[LLMEngine]:
    """One TP=2 engine per variant; closed before the next one starts (one group a process)."""
    threads = torch.get_num_threads()
    engine = make_engine(variant, tensor_parallel_size=2, block_size=4)
    try:
        yield engine
    finally:
        engine.close()
        torch.set_num_threads(threads)


class TestParity:
    """Each variant against transformers and the single-device engine."""

    def test_logits_match_transformers(self, variant: Path, tp_engine: LLMEngine) -> None:
        hf = AutoModelForCausalLM.from_pretrained(variant, dtype=torch.float32).eval()
        with record_logits(tp_engine) as records:
            run_staggered(tp_engine, prompts(4), max_tokens=6)
        assert len(records) == 4 * 6
        for tokens, logits in records:
            ref = hf_logits(hf, tokens)
            assert torch.allclose(logits, ref, atol=1e-4, rtol=0), (logits - ref).abs().max()

    def test_greedy_is_token_identical_to_one_device_and_transformers(
        self, variant: Path, tp_engine: LLMEngine
    ) -> None:
        hf = AutoModelForCausalLM.from_pretrained(variant, dtype=torch.float32).eval()
        ps = prompts()
        expected = {i: hf_greedy(hf, p, 32) for i, p in enumerate(ps)}
        single = make_engine(variant, block_size=4)
        assert run_staggered(single, ps, 32, join_every=3) == expected
        assert run_staggered(tp_engine, ps[:1], 32) == {0: expected[0]}
        # 8 prompts of different lengths joining every 3 steps (the prefix cache now holds the
        # first run's blocks, so prefill chunks with cached context are broadcast too).
        assert run_staggered(tp_engine, ps, 32, join_every=3) == expected
        assert tp_engine.failure is None

    def test_each_rank_caches_only_its_kv_heads(self, variant: Path, tp_engine: LLMEngine) -> None:
        cfg = read_model_config(variant)
        single = make_engine(variant, block_size=4)
        cache = tp_engine.runner.kv_caches[0]
        assert cache.shape[2] == cfg.num_key_value_heads // 2
        assert single.runner.kv_caches[0].shape[2] == cfg.num_key_value_heads
        # The same per-rank budget buys twice the blocks when a rank holds half the heads.
        assert tp_engine.kv.num_blocks == 2 * single.kv.num_blocks
        assert cache.numel() == single.runner.kv_caches[0].numel()


def test_chunked_prefill_and_preemption(tiny_llama: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ps = prompts()
    expected = {i: hf_greedy(hf, p, 32) for i, p in enumerate(ps)}
    # Per rank: 2 layers * 2 (K,V) * 1 kv head * 16 dims * 4 bytes = 256 bytes a token.
    engine = make_engine(
        tiny_llama,
        tensor_parallel_size=2,
        block_size=4,
        kv_cache_memory=256 * 4 * 40,
        max_num_batched_tokens=16,
    )
    try:
        assert engine.kv.num_blocks == 40
        assert run_staggered(engine, ps, 32, join_every=2) == expected
        assert engine.scheduler.num_preemptions > 0
    finally:
        engine.close()


def test_step_wire_format_round_trips(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, block_size=4, max_num_batched_tokens=16)
    engine.runner.use_kernels(None)  # as with tensor parallelism: steps carry the mask
    seen: list[dict[str, int]] = []
    execute = engine.runner.execute

    def checking(inputs: StepInputs) -> torch.Tensor:
        values, payload = pack_step(inputs.input_ids, inputs.positions, inputs.meta)
        ids, positions, meta = unpack_step(values, payload, engine.runner.block_size)
        ref = inputs.meta
        assert torch.equal(ids, inputs.input_ids) and torch.equal(positions, inputs.positions)
        assert torch.equal(meta.slot_mapping, ref.slot_mapping)
        assert meta.num_decodes == ref.num_decodes and meta.block_size == ref.block_size
        if ref.num_decodes:
            assert torch.equal(meta.decode_block_tables, ref.decode_block_tables)
            assert torch.equal(meta.decode_mask, ref.decode_mask)
        else:
            assert meta.decode_block_tables is None and meta.decode_mask is None
        assert len(meta.prefills) == len(ref.prefills)
        for got, want in zip(meta.prefills, ref.prefills, strict=True):
            assert (got.start, got.end, got.num_computed) == (
                want.start,
                want.end,
                want.num_computed,
            )
            if want.context_blocks is None:
                assert got.context_blocks is None
            else:
                assert torch.equal(got.context_blocks, want.context_blocks)
        seen.append(
            {
                "decodes": ref.num_decodes,
                "chunks": len(ref.prefills),
                "ctx": sum(c.context_blocks is not None for c in ref.prefills),
                "width": 0 if ref.decode_block_tables is None else ref.decode_block_tables.shape[1],
                "bytes": payload.numel() * 8,
            }
        )
        return execute(inputs)

    engine.runner.execute = checking  # type: ignore[method-assign]
    run_staggered(engine, prompts(4), max_tokens=5, join_every=2)
    assert any(s["decodes"] and s["chunks"] for s in seen)  # mixed steps
    assert any(s["ctx"] for s in seen)  # chunks attending to cached context
    # A decode-only step: token id, position and slot per sequence plus its block-table row.
    decode_only = [s for s in seen if s["decodes"] and not s["chunks"]]
    assert decode_only
    assert all(s["bytes"] == 8 * s["decodes"] * (3 + s["width"]) for s in decode_only)


def test_heads_that_do_not_divide_are_a_clear_error(tmp_path: Path) -> None:
    folder = build_model(tmp_path / "mqa", "llama", num_key_value_heads=1)
    with pytest.raises(UnsupportedModelError) as err:
        make_engine(folder, tensor_parallel_size=2)
    message = str(err.value)
    assert "tensor_parallel_size=2" in message and "num_key_value_heads=1" in message
    assert not dist.is_initialized()  # refused before any rank was started
    cfg = read_model_config(folder)
    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads=4, .*intermediate"):
        check_tensor_parallel(replace(cfg, num_key_value_heads=3, intermediate_size=130), 3)
    check_tensor_parallel(cfg, 1)


def test_single_device_uses_no_torch_distributed(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    assert engine.runner.leader is None and engine.runner.tp_size == 1
    assert not dist.is_initialized()
    engine.close()


def test_a_dead_helper_fails_the_group_and_close_returns(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, tensor_parallel_size=2)
    leader = engine.runner.leader
    assert leader is not None
    failures: list[str] = []
    leader.on_failure = failures.append
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.add_request("a", [5, 6, 7], params)
        while engine.has_unfinished():
            engine.step()
        os.kill(leader.procs[0].pid, signal.SIGKILL)
        # The group is marked failed first, then its helpers are killed, then `on_failure` runs:
        # wait for the last (the failure alone can be seen a moment before the callback).
        wait_for(lambda: bool(failures), 5.0)
        assert engine.failure is not None and "rank 1" in failures[0]
        engine.add_request("b", [5, 6, 7], params)
        with pytest.raises(TensorParallelError, match="rank 1"):
            engine.step()
    finally:
        started = time.monotonic()
        engine.close()
        assert time.monotonic() - started < 5
    assert not dist.is_initialized()


# ----- the worker process --------------------------------------------------------------------


def wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def children_of(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _stat(int(entry.name)) == (pid, True):
            found.append(int(entry.name))
    return found


def _stat(pid: int) -> tuple[int, bool] | None:
    """(parent pid, alive and not a zombie), or None for no such process."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0] not in ("Z", "X")


def gone(pid: int) -> bool:
    stat = _stat(pid)
    return stat is None or not stat[1]


WORKER_ENV = {
    "MODELYARD_DTYPE": "float32",
    "MODELYARD_KV_CACHE_MEMORY": "16MiB",
    "MODELYARD_MAX_TOKENS_CAP": "256",
}
MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]


def tp_worker(model: Path) -> WorkerProcess:
    worker = WorkerProcess(str(model), WORKER_ENV, "--tensor-parallel-size", "2")
    worker.wait_ready()
    return worker


def chat(worker: WorkerProcess, model: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return resp.choices[0].message.content or "", resp.usage.completion_tokens  # type: ignore[union-attr]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_worker_tp2_answers_like_tp1_and_leaves_no_rank_behind(tiny_llama: Path) -> None:
    single = WorkerProcess(str(tiny_llama), WORKER_ENV)
    try:
        single.wait_ready()
        expected = chat(single, tiny_llama.name)
    finally:
        single.stop()
    worker = tp_worker(tiny_llama)
    try:
        helpers = children_of(worker.proc.pid)
        assert len(helpers) == 1
        assert chat(worker, tiny_llama.name) == expected and expected[1] == 24 and expected[0]
        worker.proc.terminate()  # what the platform does to stop a replica
        worker.proc.wait(timeout=20)
        worker.log.seek(0)
        log = worker.log.read()
        # Rank 0 told the helper to stop (no kill, no error on either rank).
        assert "Traceback" not in log and "killing" not in log and "ERROR" not in log, log
    finally:
        worker.stop()
    wait_for(lambda: all(gone(pid) for pid in helpers), 10.0)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_worker_exits_when_a_helper_rank_dies(tiny_llama: Path) -> None:
    worker = tp_worker(tiny_llama)
    try:
        (helper,) = children_of(worker.proc.pid)
        os.kill(helper, signal.SIGKILL)
        worker.proc.wait(timeout=30)
        assert worker.proc.returncode != 0
    finally:
        worker.stop()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_helper_rank_dies_with_rank_zero(tiny_llama: Path) -> None:
    worker = tp_worker(tiny_llama)
    try:
        (helper,) = children_of(worker.proc.pid)
        worker.proc.kill()
        worker.proc.wait(timeout=10)
        wait_for(lambda: gone(helper), 10.0)
    finally:
        worker.stop()
