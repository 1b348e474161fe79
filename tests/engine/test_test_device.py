"""The device the engine tests run on (`MODELYARD_TEST_DEVICE`, set by benchmarks/gpu.sh): the
engine is really there, and its logits agree with a CPU engine's on the same tiny model."""

from __future__ import annotations

from pathlib import Path

import torch

from modelyard.config import EngineSettings
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.sequence import Sequence
from tests.engine.test_spec_decode import greedy
from tests.parity import TEST_DEVICE, make_engine


def test_the_engine_runs_on_the_test_device(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    if TEST_DEVICE is not None:
        assert engine.runner.device == torch.device(TEST_DEVICE)
        assert engine.runner.kv_caches[0].device == torch.device(TEST_DEVICE)
    cpu = LLMEngine.from_settings(
        tiny_llama, EngineSettings(device="cpu", dtype="float32", kv_cache_memory=64 * 2**20)
    )
    prompt = list(range(3, 40))
    rows = []
    for e in (engine, cpu):
        seq = Sequence(0, "r", 0, len(prompt), list(prompt), greedy(4))
        assert e.kv.allocate(seq, len(prompt))
        rows.append(e.runner.execute(e.runner.prepare([(seq, len(prompt))]))[0].cpu())
    torch.testing.assert_close(rows[0], rows[1], atol=2e-3, rtol=2e-3)
