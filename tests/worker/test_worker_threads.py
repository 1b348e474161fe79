"""A served engine on CPU leaves one core to its worker's HTTP server and event loop (torch's
spinning OpenMP threads starved the loop that streams tokens); a configured `num_threads` and
tensor-parallel ranks (which split the cores themselves) keep theirs."""

from __future__ import annotations

from modelyard.config import EngineSettings
from modelyard.engine.client import served_settings
from modelyard.engine.cores import usable_cores


def test_a_cpu_worker_leaves_one_core_to_its_server() -> None:
    cores = usable_cores()
    served = served_settings(EngineSettings(device="cpu"))
    assert served.num_threads == (cores - 1 if cores > 1 else None)
    assert served_settings(EngineSettings(device="cpu", num_threads=3)).num_threads == 3
    ranks = served_settings(EngineSettings(device="cpu", tensor_parallel_size=2))
    assert ranks.num_threads is None
