"""Device inventory and replica placement: declared and discovered devices, sharing, multi-device
replicas on one node, best fit decreasing, spreading, unschedulable reasons, release, admission."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from modelyard.control import devices as devices_module
from modelyard.control.devices import Device, inventory, pinning_env
from modelyard.control.placement import (
    GiB,
    Placement,
    ReplicaRequest,
    max_concurrency,
    replica_memory,
    weights_bytes,
)
from modelyard.control.replicas import scale_down_order
from modelyard.control.state import Replica

GB = 10**9


def req(replica: str, endpoint: str, gib: float, count: int = 1) -> ReplicaRequest:
    return ReplicaRequest(replica, endpoint, int(gib * GiB), count)


def names(devices: list[Device]) -> list[str]:
    return [d.name for d in devices]


# -- inventory -------------------------------------------------------------------------------


def test_declared_inventory() -> None:
    four = inventory("cpu:4x6GiB")
    assert names(four) == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert all(d.memory_bytes == 6 * GiB and d.node == "local" and d.kind == "cpu" for d in four)

    mixed = inventory("cpu:2x8GiB, cpu:1x16GiB", node="n1")
    assert [(d.name, d.memory_bytes // GiB) for d in mixed] == [
        ("cpu:0", 8),
        ("cpu:1", 8),
        ("cpu:2", 16),
    ]
    assert mixed[2].qualified_name == "n1/cpu:2"

    gpus = inventory("cuda:2x80GiB")
    assert names(gpus) == ["cuda:0", "cuda:1"] and gpus[0].memory_bytes == 80 * GiB
    assert inventory("cuda:80GB")[0].memory_bytes == 80 * GB  # the count defaults to one


@pytest.mark.parametrize(
    "spec",
    ["", "gpu:2x80GiB", "cuda", "cuda:2x", "cpu:0x4GiB", "cpu:4xlots", "cpu:4x6GiB;cpu:1x8GiB"],
)
def test_bad_inventory_specs_show_the_expected_form(spec: str) -> None:
    with pytest.raises(ValueError, match=r"expected KIND:COUNTxSIZE.*e\.g\. cpu:4x6GiB"):
        inventory(spec)


def test_discovered_inventory_cuda_then_ram(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = types.ModuleType("torch")
    count = {"n": 2}
    fake.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        device_count=lambda: count["n"],
        get_device_properties=lambda i: types.SimpleNamespace(total_memory=(80 + i) * GiB),
    )
    monkeypatch.setitem(sys.modules, "torch", fake)
    # No GPU driver on the node: torch is not asked (its import costs serve seconds).
    monkeypatch.setattr(devices_module, "_GPU_DRIVER_PATHS", (tmp_path / "no-nvidiactl",))
    assert [d.kind for d in inventory(None, node="gpu-1")] == ["cpu"]
    monkeypatch.setattr(devices_module, "_GPU_DRIVER_PATHS", (tmp_path,))
    found = inventory(None, node="gpu-1")
    assert [(d.qualified_name, d.memory_bytes // GiB) for d in found] == [
        ("gpu-1/cuda:0", 80),
        ("gpu-1/cuda:1", 81),
    ]

    count["n"] = 0  # no CUDA: one CPU budget of 80 % of MemTotal
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16777216 kB\nMemFree:        1 kB\n")
    monkeypatch.setattr(devices_module, "_MEMINFO", meminfo)
    (cpu,) = inventory(None)
    assert cpu.name == "cpu:0" and cpu.memory_bytes == int(16 * GiB * 0.8)

    monkeypatch.setattr(devices_module, "_MEMINFO", tmp_path / "absent")
    assert inventory(None)[0].memory_bytes == int(8 * GiB * 0.8)


# -- sizing and admission --------------------------------------------------------------------


def test_replica_memory_and_quantized_weights() -> None:
    seven_b = 7_000_000_000
    assert weights_bytes(seven_b, 16) == 14 * GB
    assert weights_bytes(seven_b, 4) == weights_bytes(seven_b, 8) // 2 == 3_500_000_000
    assert replica_memory(weights_bytes(seven_b, 4), 2 * GiB) == 3_500_000_000 + 2 * GiB + 2**29
    with pytest.raises(ValueError, match="bits"):
        weights_bytes(seven_b, 3)


def test_max_concurrency_on_the_spec_example() -> None:
    assert max_concurrency(80 * GB, 35 * GB, 4 * GB) == 11
    assert max_concurrency(80 * GB, 79 * GB, 4 * GB) == 1  # always admits one


# -- placement -------------------------------------------------------------------------------


def test_small_models_share_a_device_while_a_two_device_model_takes_two() -> None:
    placement = Placement(inventory("cpu:4x6GiB"))
    result = placement.place(
        [req("a-0", "small-a", 2), req("big-0", "big", 5, count=2), req("b-0", "small-b", 2)]
    )
    assert not result.unschedulable
    assert names(result.assignments["big-0"]) == ["cpu:0", "cpu:1"]
    assert names(result.assignments["a-0"]) == names(result.assignments["b-0"]) == ["cpu:2"]
    assert placement.usage() == {
        "cpu:0": (5 * GiB, 6 * GiB),
        "cpu:1": (5 * GiB, 6 * GiB),
        "cpu:2": (4 * GiB, 6 * GiB),
        "cpu:3": (0, 6 * GiB),
    }
    assert placement.occupied_devices == 3


def test_small_models_pack_and_leave_the_big_device_for_a_big_model() -> None:
    placement = Placement(inventory("cpu:2x8GiB,cpu:1x16GiB"))
    smalls = [req(f"s{i}", f"small{i}", 2) for i in range(3)]
    first = placement.place(smalls)
    assert {r: names(d) for r, d in first.assignments.items()} == {
        "s0": ["cpu:0"],
        "s1": ["cpu:0"],
        "s2": ["cpu:0"],
    }
    later = placement.place([req("L", "large", 14)])
    assert names(later.assignments["L"]) == ["cpu:2"]


def first_fit(capacities: list[int], sizes: list[int]) -> list[int | None]:
    """The naive rule to beat: in arrival order, each onto the first device that fits."""
    free = list(capacities)
    where: list[int | None] = []
    for size in sizes:
        slot = next((i for i, f in enumerate(free) if f >= size), None)
        if slot is not None:
            free[slot] -= size
        where.append(slot)
    return where


def test_best_fit_decreasing_packs_what_first_fit_cannot() -> None:
    sizes = [5, 6, 4, 5]  # GiB, in arrival order, onto two 10 GiB devices
    # First fit: 5 -> cpu:0, 6 -> cpu:1, 4 -> cpu:0 (1 left), 5 -> nowhere (1 and 4 free).
    assert first_fit([10, 10], sizes) == [0, 1, 0, None]

    placement = Placement(inventory("cpu:2x10GiB"))
    result = placement.place([req(f"r{i}", f"e{i}", s) for i, s in enumerate(sizes)])
    # Best fit decreasing: 6 -> cpu:0, 5 -> cpu:1, 5 -> cpu:1 (full), 4 -> cpu:0 (full).
    assert not result.unschedulable
    assert {r: names(d) for r, d in result.assignments.items()} == {
        "r1": ["cpu:0"],
        "r0": ["cpu:1"],
        "r3": ["cpu:1"],
        "r2": ["cpu:0"],
    }
    assert all(used == total for used, total in placement.usage().values())


def test_a_multi_device_replica_needs_its_devices_on_one_node() -> None:
    fleet = inventory("cuda:2x80GiB", node="n1") + inventory("cuda:2x80GiB", node="n2")
    placement = Placement(fleet)
    placement.place([req("x", "other", 50, count=1)])  # n1/cuda:0 now has 30 GiB free
    result = placement.place([req("tp", "llama-70b", 70, count=2)])
    # Three devices have 70 GiB free, but only n2 has two of them.
    assert [d.qualified_name for d in result.assignments["tp"]] == ["n2/cuda:0", "n2/cuda:1"]

    too_wide = placement.place([req("tp3", "llama-405b", 10, count=3)])
    assert too_wide.unschedulable == {
        "tp3": "needs 3 devices with 10.0 GiB free on one node; the best node has 2"
    }


def test_replicas_of_one_endpoint_spread_across_nodes_then_devices() -> None:
    fleet = inventory("cpu:2x8GiB", node="n1") + inventory("cpu:2x8GiB", node="n2")
    placement = Placement(fleet)
    result = placement.place([req(f"chat-{i}", "chat", 1) for i in range(3)])
    nodes = [result.assignments[f"chat-{i}"][0].qualified_name for i in range(3)]
    # Best fit alone would stack all three on n1/cpu:0; spreading uses both nodes first, then
    # prefers a device of n1 that holds no replica of the endpoint yet.
    assert nodes == ["n1/cpu:0", "n2/cpu:0", "n1/cpu:1"]

    single = Placement(inventory("cpu:2x8GiB"))
    placed = single.place([req("a", "chat", 3), req("b", "chat", 3)])
    assert names(placed.assignments["a"]) == ["cpu:0"] and names(placed.assignments["b"]) == [
        "cpu:1"
    ]


def test_after_two_nodes_replicas_fill_holes_instead_of_opening_devices() -> None:
    fleet = [d for n in ("n1", "n2", "n3") for d in inventory("cpu:2x8GiB", node=n)]
    placement = Placement(fleet)
    placement.place([req("a", "other-a", 5)])  # n1/cpu:0
    placement.place([req("b", "other-b", 5)])  # n1/cpu:1 (3 GiB left on each)
    result = placement.place([req(f"chat-{i}", "chat", 1) for i in range(3)])
    where = [result.assignments[f"chat-{i}"][0].qualified_name for i in range(3)]
    # Two nodes for availability; the third replica goes into the hole on n1/cpu:1 rather than
    # opening n3, which stays empty and can be given back.
    assert where == ["n1/cpu:0", "n2/cpu:0", "n1/cpu:1"]
    assert placement.occupied_devices == 3


def test_spreading_never_refuses_a_placement() -> None:
    placement = Placement(inventory("cpu:2x8GiB"))
    placement.place([req("big", "other", 7)])  # cpu:0 has 1 GiB free
    result = placement.place([req("c0", "chat", 3), req("c1", "chat", 3)])
    assert not result.unschedulable
    assert names(result.assignments["c0"]) == names(result.assignments["c1"]) == ["cpu:1"]


def test_unschedulable_requests_are_explained_and_change_nothing() -> None:
    placement = Placement(inventory("cpu:2x8GiB,cpu:1x16GiB"))
    placement.place([req("a", "a", 6.5), req("b", "b", 6.5)])  # cpu:0 and cpu:1, 1.5 GiB left
    placement.place([req("m", "medium", 8.5)])  # cpu:2, 7.5 GiB left
    before = placement.usage()
    result = placement.place([req("huge", "huge", 12), req("pair", "pair", 7.5, count=2)])
    assert result.assignments == {}
    assert result.unschedulable == {
        "huge": "needs 12.0 GiB; the largest free space is 7.5 GiB on cpu:2",
        "pair": "needs 2 devices with 7.5 GiB free on one node; the best node has 1",
    }
    assert placement.usage() == before
    assert placement.assignment("huge") is None

    with pytest.raises(ValueError, match="already placed"):
        placement.place([req("m", "medium", 1)])


def test_release_frees_the_memory_for_the_next_replica() -> None:
    placement = Placement(inventory("cpu:2x6GiB"))
    placement.place([req("tp", "big", 5, count=2)])
    assert placement.place([req("x", "other", 4)]).unschedulable
    freed = placement.release("tp")
    assert names(freed) == ["cpu:0", "cpu:1"]
    assert placement.occupied_devices == 0
    assert all(placement.free_bytes(d) == 6 * GiB for d in placement.devices)
    assert names(placement.place([req("x", "other", 4)]).assignments["x"]) == ["cpu:0"]
    with pytest.raises(KeyError):
        placement.release("tp")


def test_placement_is_deterministic() -> None:
    fleet = [d for n in ("b", "a") for d in inventory("cuda:4x80GiB", node=n)]
    batch = [req(f"r{i}", f"e{i % 7}", 5 + (i * 37) % 60, count=1 + i % 3) for i in range(30)]
    runs = []
    for _ in range(2):
        placement = Placement(list(reversed(fleet)))
        result = placement.place(batch)
        runs.append(
            (
                {r: [d.qualified_name for d in ds] for r, ds in result.assignments.items()},
                result.unschedulable,
            )
        )
    assert runs[0] == runs[1]
    assert next(iter(runs[0][0].values()))[0].startswith("a/")  # ties go to the first node


def test_kinds_are_not_mixed_and_devices_are_unique() -> None:
    placement = Placement(inventory("cpu:1x8GiB,cuda:1x80GiB,cuda:1x8GiB"))
    on_gpu = placement.place([ReplicaRequest("g", "gpu-model", 4 * GiB, kind="cuda")])
    assert names(on_gpu.assignments["g"]) == ["cuda:1"]  # best fit among cuda devices only
    # Two 6 GiB ranks: cpu:0 and cuda:0 have room, but a replica's ranks share one kind.
    pair = placement.place([req("p", "pair", 6, count=2)])
    assert pair.unschedulable == {
        "p": "needs 2 devices with 6.0 GiB free on one node; the best node has 1"
    }
    none = Placement(inventory("cpu:1x8GiB")).place([ReplicaRequest("x", "x", GiB, kind="cuda")])
    assert none.unschedulable == {"x": "needs 1.0 GiB; there is no cuda device"}
    with pytest.raises(ValueError, match="listed twice"):
        Placement(inventory("cpu:1x8GiB") + inventory("cpu:1x4GiB"))


def test_drain_order_empties_whole_devices_first() -> None:
    placement = Placement(inventory("cpu:2x8GiB"))
    placement.place([req("busy-neighbour", "other", 5)])  # cpu:0
    placement.place([req("a", "chat", 2), req("b", "chat", 2)])  # a on cpu:0, b on cpu:1
    assert names(placement.assignment("a") or []) == ["cpu:0"]
    assert names(placement.assignment("b") or []) == ["cpu:1"]
    # Removing b frees cpu:1 entirely; removing a would leave cpu:0 holding 5 GiB anyway.
    assert placement.drain_order(["a", "b"]) == ["b", "a"]


def test_scale_down_drops_starting_replicas_then_the_ones_that_empty_a_device() -> None:
    placement = Placement(inventory("cpu:2x8GiB"))
    placement.place([req("busy-neighbour", "other", 5)])  # cpu:0
    placement.place([req("a", "chat", 2), req("b", "chat", 2), req("c", "chat", 2)])
    ready = [Replica(i, state="ready", placement_id=i, started_at=n) for n, i in enumerate("abc")]
    loading = Replica("d", state="starting", started_at=10.0)
    order = [r.replica_id for r in scale_down_order([*ready, loading], placement)]
    # The loading one first; then whichever of a/b/c leaves least behind on its device.
    assert order[0] == "d"
    on_cpu1 = [r for r in "abc" if names(placement.assignment(r) or []) == ["cpu:1"]]
    assert order[1] in on_cpu1 and sorted(order[1:]) == ["a", "b", "c"]


def test_a_retry_avoids_the_device_where_the_load_failed_unless_nothing_else_fits() -> None:
    placement = Placement(inventory("cpu:2x8GiB"))
    first = placement.place([req("try-1", "chat", 3)])
    failed = {d.qualified_name for d in first.assignments["try-1"]}
    placement.release("try-1")
    retry = ReplicaRequest("try-2", "chat", 3 * GiB, avoid=frozenset(failed))
    where = {d.qualified_name for d in placement.place([retry]).assignments["try-2"]}
    assert where and where.isdisjoint(failed)
    # With the other device full, the avoided one is still better than unschedulable.
    placement.release("try-2")
    placement.place([ReplicaRequest("filler", "other", 7 * GiB, avoid=frozenset(failed))])
    last = ReplicaRequest("try-3", "chat", 3 * GiB, avoid=frozenset(failed))
    result = placement.place([last])
    assert not result.unschedulable
    assert {d.qualified_name for d in result.assignments["try-3"]} == failed


def test_scale_down_among_equals_drops_the_newest_replica() -> None:
    placement = Placement(inventory("cpu:1x8GiB"))
    placement.place([req("old", "chat", 2), req("new", "chat", 2)])  # both on cpu:0
    replicas = [
        Replica("old", state="ready", placement_id="old", started_at=1.0),
        Replica("new", state="ready", placement_id="new", started_at=2.0),
    ]
    assert [r.replica_id for r in scale_down_order(replicas, placement)] == ["new", "old"]


def test_a_replica_is_pinned_to_the_cuda_devices_it_was_placed_on() -> None:
    gpus = [Device("n1", i, "cuda", 80 * GiB) for i in range(4)]
    placement = Placement(gpus)
    placement.place([req("big", "other", 70)])  # cuda:0
    pair = placement.place([req("tp", "chat", 60, count=2)]).assignments["tp"]
    assert pinning_env(pair) == {"CUDA_VISIBLE_DEVICES": "1,2"}
    assert pinning_env(inventory("cpu:2x8GiB")) == {}
