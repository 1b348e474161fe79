"""Why Ray cannot place a replica (`control/backends/ray_room.py`), from each node's free and
total resources as the driver reads them (the live cluster: `test_ray_backend.py`)."""

from __future__ import annotations

from modelyard.control.backends.ray_room import explain, needs

GiB = 2**30


def test_no_node_with_a_free_cpu_is_named_with_the_counts() -> None:
    need = needs({"num_cpus": 1, "num_gpus": 0}, [])
    free = {"head": {}, "a": {"CPU": 0.0}, "b": {"CPU": 0.0}}
    total = {"head": {}, "a": {"CPU": 2.0}, "b": {"CPU": 2.0}}
    why = explain(need, free, total)
    assert why == "waiting for room on Ray: no node has 1 CPU free (4 of 4 CPU in use on 3 nodes)"


def test_a_node_with_room_is_no_reason() -> None:
    need = needs({"num_cpus": 1, "num_gpus": 0, "memory": GiB}, [])
    free = {"a": {"CPU": 0.0, "memory": 8 * GiB}, "b": {"CPU": 1.0, "memory": 2 * GiB}}
    total = {"a": {"CPU": 2.0, "memory": 8 * GiB}, "b": {"CPU": 2.0, "memory": 8 * GiB}}
    assert explain(need, free, total) is None


def test_room_split_over_nodes_is_no_room_for_a_tensor_parallel_replica() -> None:
    # Two GPUs free, one on each node: a STRICT_PACK replica of two ranks needs both on one.
    need = needs({"num_cpus": 1, "num_gpus": 1}, [{"CPU": 1.0, "GPU": 1.0}] * 2)
    assert need == {"CPU": 2.0, "GPU": 2.0}
    free = {"a": {"CPU": 4.0, "GPU": 1.0}, "b": {"CPU": 4.0, "GPU": 1.0}}
    total = {"a": {"CPU": 4.0, "GPU": 2.0}, "b": {"CPU": 4.0, "GPU": 2.0}}
    why = explain(need, free, total)
    assert why is not None and "no node has 2 CPU and 2 GPU free (2 of 4 GPU in use" in why
