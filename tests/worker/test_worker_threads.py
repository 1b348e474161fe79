"""A served engine on CPU leaves one core to its worker's HTTP server and event loop (torch's
spinning OpenMP threads starved the loop that streams tokens); a configured `num_threads` and
tensor-parallel ranks (which split the cores themselves) keep theirs, and an engine whose small
decode steps run in one C call gets every core; the prompt threads run
before the first request (none is started on the event loop)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from modelyard.config import EngineSettings
from modelyard.engine.client import LocalEngineClient, served_settings
from modelyard.engine.cores import usable_cores
from modelyard.engine.quantization import fbgemm_available
from modelyard.worker.openai_serving import started_pool
from tests.tiny_gguf import build_gguf


def test_a_cpu_worker_leaves_one_core_to_its_server() -> None:
    cores = usable_cores()
    served = served_settings(EngineSettings(device="cpu"))
    assert served.num_threads == (cores - 1 if cores > 1 else None)
    assert served_settings(EngineSettings(device="cpu", num_threads=3)).num_threads == 3
    ranks = served_settings(EngineSettings(device="cpu", tensor_parallel_size=2))
    assert ranks.num_threads is None


@pytest.mark.skipif(usable_cores() < 2, reason="one core: nothing to leave")
@pytest.mark.skipif(not fbgemm_available(), reason="gguf+w8a8 needs FBGEMM (x86)")
def test_an_engine_deciding_in_one_c_call_takes_every_core(tmp_path: Path) -> None:
    """Under gguf+w8a8 a small decode step runs no torch op: the served engine's torch threads
    (prefill, wider steps) get the core back; dequantized, one is left to the server."""
    path = build_gguf(tmp_path / "tiny.Q4_1.gguf", "Q4_1")
    threads = torch.get_num_threads()
    try:
        for quantization, want in (("gguf+w8a8", usable_cores()), ("none", usable_cores() - 1)):
            settings = EngineSettings(
                device="cpu", quantization=quantization, kv_cache_memory=2**24
            )
            torch.set_num_threads(usable_cores())  # as a worker process starts
            client = LocalEngineClient.load(path, settings)
            try:
                assert torch.get_num_threads() == want, quantization
            finally:
                client.shutdown()
    finally:
        torch.set_num_threads(threads)


def test_the_prompt_pool_starts_its_threads_before_any_request() -> None:
    """No request starts a thread on the event loop (which waits for the thread to run)."""
    pool = started_pool(4, "probe-prompt")
    try:
        running = [t for t in threading.enumerate() if t.name.startswith("probe-prompt")]
        assert len(running) == 4 and all(t.is_alive() for t in running)
        assert pool.submit(lambda: 7).result() == 7
        after = [t for t in threading.enumerate() if t.name.startswith("probe-prompt")]
        assert len(after) == 4
    finally:
        pool.shutdown()
