"""A served engine on CPU leaves one core to its worker's HTTP server and event loop (torch's
spinning OpenMP threads starved the loop that streams tokens); a configured `num_threads` and
tensor-parallel ranks (which split the cores themselves) keep theirs; the prompt threads run
before the first request (none is started on the event loop)."""

from __future__ import annotations

import threading

from modelyard.config import EngineSettings
from modelyard.engine.client import served_settings
from modelyard.engine.cores import usable_cores
from modelyard.worker.openai_serving import started_pool


def test_a_cpu_worker_leaves_one_core_to_its_server() -> None:
    cores = usable_cores()
    served = served_settings(EngineSettings(device="cpu"))
    assert served.num_threads == (cores - 1 if cores > 1 else None)
    assert served_settings(EngineSettings(device="cpu", num_threads=3)).num_threads == 3
    ranks = served_settings(EngineSettings(device="cpu", tensor_parallel_size=2))
    assert ranks.num_threads is None


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
