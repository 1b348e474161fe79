"""The fleet simulator's accounting on fleets small enough to compute by hand.

benchmarks/fleet_sim.py reports token-slot utilization, device-hours, node-hours and cold-start
waits; these tests build one- and two-endpoint fleets with round numbers (a replica of 4 slots
whose decode step is 10 ms and prefill 100 ms), drive them tick by tick with the simulator's
own `Fleet` and `serve`, and check every figure against the arithmetic written out here, so
the headline numbers cannot drift from their definitions. The last test runs the command's
quick mode on the Azure traces (skipped when the data is not beside the checkout).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from fleetsim import service as svc  # noqa: E402
from fleetsim.fleet import Fleet, Policy  # noqa: E402
from fleetsim.metrics import Counters  # noqa: E402
from fleetsim.serving import serve  # noqa: E402
from fleetsim.trace import default_dir, from_rows  # noqa: E402
from fleetsim.workload import Endpoints, Workload, WorkloadSpec  # noqa: E402

GiB = 2**30
TICK = 2.0
PROMPT, GENERATED = 100, 10
WEIGHTS = 12e9  # bytes: cold start = 5 s + 12e9/6e9 (cache) [+ 12e9/2.5e9 (store)]


def _service(n: int, mem_gib: float = 40.0, tp: int = 1) -> svc.Service:
    """n endpoints of one hand-sized model: 4 slots, step 10 ms, prefill 100 ms."""
    ones = np.ones(n)
    dev_s_full = 0.1 + GENERATED * 0.01 / 4  # 0.125 device-seconds per request at 4 slots
    return svc.Service(
        tp=np.full(n, tp),
        mem_dev=np.full(n, int(mem_gib * GiB)),
        weights=ones * WEIGHTS,
        slots=np.full(n, 4),
        c0=ones * 0.01,
        c1=ones * 0.0,
        pf0=ones * 0.1,
        pf1=ones * 0.0,
        mean_prompt=ones * PROMPT,
        mean_generated=ones * GENERATED,
        dev_s_full=ones * dev_s_full,
        capacity=ones * (PROMPT + GENERATED) / dev_s_full,  # 880 tokens/s
        host=svc.HostCost(0.0, 0.0, "test"),
        device=svc.DEVICES["h100"],
    )


def _workload(n: int) -> Workload:
    stamps = np.arange(100, dtype=float)
    trace = from_rows("conv", stamps, np.full(100, PROMPT), np.full(100, GENERATED))
    eps = Endpoints(
        model=np.zeros(n, dtype=np.int64),
        kind=np.zeros(n, dtype=np.int64),
        mean_rps=np.ones(n),
        phase_h=np.zeros(n),
        offset=np.zeros(n, dtype=np.int64),
    )
    return Workload(WorkloadSpec(endpoints=n), eps, {"conv": trace, "code": trace})


def _run(fleet: Fleet, work: Workload, ticks: range, per_tick: list[int]) -> None:
    rng = np.random.default_rng(0)
    for k in ticks:
        a = np.array(per_tick)
        fleet.begin_tick(k)
        fleet.activate(k, a, rng)
        serve(fleet, work, k, a, a * float(PROMPT), a * float(GENERATED), rng)
        fleet.control(k, a)


def test_one_replica_alone_utilization_device_and_node_seconds() -> None:
    fleet = Fleet("t", Policy(autoscale=False), _service(1), nodes=1)
    fleet.scale_up(0, 1, 0.0, ready_now=True)
    fleet.counters = Counters.for_delays(600.0, 1)
    _run(fleet, _workload(1), range(10), [4])  # 2 requests/s for 20 s
    s = fleet.counters.summary(20.0)
    # 40 requests x 110 tokens; capacity 880 tokens/s x 20 s on the one provisioned device.
    assert fleet.counters.tokens == pytest.approx(40 * 110)
    assert s["token_slot_utilization_pct"] == pytest.approx(100 * 4400 / (880 * 20))  # 25 %
    assert s["device_hours"] * 3600 == pytest.approx(20.0)
    assert s["node_hours"] * 3600 == pytest.approx(20.0)
    # Warm TTFT: no wait, alone on its device: prefill 0.1 s + half a 10 ms step.
    assert s["ttft_warm_p50_s"] == pytest.approx(0.105, abs=1e-6)
    assert s["ttft_warm_p99.9_s"] == pytest.approx(0.105, abs=1e-6)
    assert s["cold_request_pct"] == 0.0
    # The old figure: the replica has 0.1 + 0.25... requests in flight, < 1, and holds half
    # the device: engine-busy = in flight x 40/80.
    assert 0 < s["engine_busy_pct"] < 50


def test_two_engines_share_a_device_and_slow_each_other() -> None:
    fleet = Fleet("t", Policy(autoscale=False), _service(2), nodes=1)
    fleet.scale_up(0, 1, 0.0, ready_now=True)
    fleet.scale_up(1, 1, 0.0, ready_now=True)
    assert fleet.counters.by_delay  # placed: both on one 80 GiB device (40 GiB each)
    assert int((fleet.dev_n > 0).sum()) == 1
    fleet.counters = Counters.for_delays(600.0, 2)
    _run(fleet, _workload(2), range(10), [4, 4])
    s = fleet.counters.summary(20.0)
    # Capacity of the shared device: the mean of its replicas' (880 each); tokens 2 x 4400.
    assert s["token_slot_utilization_pct"] == pytest.approx(100 * 8800 / (880 * 20))  # 50 %
    assert s["device_hours"] * 3600 == pytest.approx(20.0)
    # Each engine alone would use 2/s x (0.1 s prefill + 10 tokens x 10 ms) = 0.4 of the device;
    # the other's 0.4 slows it by 1 / (1 - 0.4): TTFT = (0.1 + 0.01 / 2) / 0.6.
    assert s["ttft_warm_p50_s"] == pytest.approx(0.105 / 0.6, abs=1e-6)
    groups = fleet.counters.by_group({"a": np.array([0]), "b": np.array([1])})
    assert groups["a"]["device_share_pct"] == pytest.approx(50.0)
    assert groups["a"]["token_slot_utilization_pct"] == pytest.approx(50.0)


def test_node_seconds_count_nodes_and_release_delays_keep_devices() -> None:
    # Two endpoints of 70 GiB replicas: two devices of one node.
    fleet = Fleet("t", Policy(autoscale=False, release_delay_s=600.0), _service(2, 70.0), nodes=1)
    fleet.scale_up(0, 1, 0.0, ready_now=True)
    fleet.scale_up(1, 1, 0.0, ready_now=True)
    fleet.counters = Counters.for_delays(600.0, 2)
    work = _workload(2)
    _run(fleet, work, range(5), [0, 0])  # 10 s with both
    fleet.scale_down(0, 1, 4)  # drained during tick 5's start: freed at t = 10 s
    _run(fleet, work, range(5, 400), [0, 0])  # to t = 800 s
    c = fleet.counters
    dev = {d: row[0] for d, row in c.by_delay.items()}
    nodes = {d: row[1] for d, row in c.by_delay.items()}
    # Endpoint 1's device all 800 s; endpoint 0's device 10 s, plus the delay while it lasts.
    assert dev[0.0] == pytest.approx(800 + 10)
    assert dev[600.0] == pytest.approx(800 + 10 + 600)
    assert dev[3600.0] == pytest.approx(800 + 800)
    assert nodes[0.0] == nodes[600.0] == nodes[3600.0] == pytest.approx(800.0)  # one node
    s = c.summary(800.0)
    assert s["by_release_delay"]["600"]["device_hours"] * 3600 == pytest.approx(1410.0)
    # Nothing was served: utilization 0 whatever the capacity.
    assert s["token_slot_utilization_pct"] == 0.0


def test_cold_start_wait_is_the_bytes_moved_at_each_layer() -> None:
    fleet = Fleet("t", Policy(), _service(1), nodes=1)
    fleet.counters = Counters.for_delays(600.0, 1)
    work = _workload(1)
    rng = np.random.default_rng(1)
    a = np.array([1])
    fleet.begin_tick(0)
    fleet.activate(0, a, rng)
    arrived = float(fleet.cold_offsets[0][0])
    # A node-cache miss: 5 s start + 12 GB from the store at 2.5 GB/s + from NVMe at 6 GB/s.
    cold = 5.0 + WEIGHTS / 2.5e9 + WEIGHTS / 6e9
    (placed,) = fleet.placed.values()
    assert placed.ready_at - arrived == pytest.approx(cold)
    serve(fleet, work, 0, a, a * float(PROMPT), a * float(GENERATED), rng)
    c = fleet.counters
    assert c.cold_requests == 1 and c.cold_sessions == 1 and c.sessions == 1
    # Its TTFT: the wait, then the prefill (0.1 s) and half a decode step (5 ms).
    assert float(np.concatenate(c.ttft)[0]) == pytest.approx(cold + 0.105)
    assert float(np.concatenate(c.wait)[0]) == pytest.approx(cold)
    # The same model again on this node comes from its cache: no store transfer.
    assert fleet.s.cold_start_s(0, True, 1.0) == pytest.approx(5.0 + WEIGHTS / 6e9)
    assert fleet.s.cold_start_s(0, True, 3.0) == pytest.approx(3 * (5.0 + WEIGHTS / 6e9))


def test_a_quiet_endpoint_goes_to_zero_after_its_idle_time() -> None:
    """The control loop skips quiet endpoints' ticks, yet scales to zero on time."""
    fleet = Fleet("t", Policy(idle_to_zero_s=300.0), _service(1), nodes=1)
    fleet.counters = Counters.for_delays(0.0, 1)
    work = _workload(1)
    _run(fleet, work, range(1), [1])  # one request at tick 0: a replica starts (11.8 s)
    _run(fleet, work, range(1, 400), [0])
    # Ready at tick 7 at the latest, idle since its request: zero after 300 s without one.
    # Devices provisioned from tick 0 until the tick it went to zero.
    seconds = fleet.counters.by_delay[0.0][0]
    assert 300 <= seconds <= 300 + 7 * TICK + 2 * TICK
    assert fleet.current[0] == 0


@pytest.mark.skipif(not default_dir().exists(), reason="Azure traces not beside the checkout")
def test_quick_mode_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fleet_sim.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "token-slot utilization %" in out.stdout
    assert "Splitwise" in out.stdout
