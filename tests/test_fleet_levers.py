"""Invariants of the fleet simulator's levers (benchmarks/fleet_levers.py, fleetsim/levers.py).

A small fleet on synthetic traces runs every kind of lever once; the checks are what must hold
whatever the numbers: with no adapters and no backfill the lever runner is the autoscaled fleet
of `runner.run_seed`, figure for figure; utilization stays within capacity; every batch token
is served at most once and served + pending = submitted; backfill never fills a device past
its cap. Hand-sized cases check adapter residency (LRU over the base's slots) and batch
windows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from fleetsim import adapters as ad  # noqa: E402
from fleetsim import batch  # noqa: E402
from fleetsim.batch import BACKFILL_CAP, Backfill, BatchDemand, BatchReplicas  # noqa: E402
from fleetsim.levers import Lever, _Run, run_levers  # noqa: E402
from fleetsim.runner import RunSpec, build, run_seed  # noqa: E402
from fleetsim.trace import from_rows  # noqa: E402
from fleetsim.variants import catalogue  # noqa: E402
from fleetsim.workload import TICK_S, Arrivals, WorkloadSpec  # noqa: E402

SPEC = RunSpec(WorkloadSpec(endpoints=30, total_rps=15.0), days=0.02, warmup_s=300.0)


def _traces() -> dict:
    rng = np.random.default_rng(5)
    out = {}
    for kind, rate in (("conv", 3.0), ("code", 1.0)):
        stamps = np.sort(rng.random(int(3600 * rate)) * 3600)
        n = len(stamps)
        out[kind] = from_rows(kind, stamps, rng.integers(50, 2000, n), rng.integers(1, 400, n))
    return out


TRACES = _traces()
CORE = (
    "token_slot_utilization_pct",
    "device_hours",
    "node_hours",
    "peak_devices",
    "requests",
    "tokens",
    "cold_request_pct",
    "rejected_pct",
    "replica_starts",
    "ttft_warm_p99_s",
    "ttft_cold_p99_s",
)


@pytest.fixture(scope="module")
def result() -> dict:
    levers = [
        Lever("autoscaled", asap=(0.5,)),
        Lever("adapters 100 %", adapters=1.0, asap=(0.25,)),
        Lever("backfill 50 %", backfill=0.5),
        Lever("backfill 50 % + adapters 80 %", adapters=0.8, backfill=0.5),
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batch, "DAY_S", 600.0)  # jobs every 10 minutes, so a short run has batch
        return run_levers(SPEC, 0, levers, traces=TRACES)


def test_no_lever_is_the_autoscaled_fleet(result: dict) -> None:
    plain = run_seed(SPEC, 0, [catalogue()["autoscaled"]], traces=TRACES)
    a, b = plain["variants"]["autoscaled"], result["variants"]["autoscaled"]
    for key in CORE:
        assert a[key] == b[key] or (np.isnan(a[key]) and np.isnan(b[key])), key
    assert b["adapter_cold_pct"] == 0.0 and b["units"] == SPEC.workload.endpoints


def test_same_arrivals_and_utilization_within_capacity(result: dict) -> None:
    variants = result["variants"]
    requests = {v["requests"] for v in variants.values()}
    assert len(requests) == 1  # every fleet saw the same real-time requests
    for v in variants.values():
        assert 0 < v["token_slot_utilization_pct"] <= 100
        for s in v["scenarios"].values():
            assert 0 < s["token_slot_utilization_pct"] <= 100
    assert variants["adapters 100 %"]["units"] < SPEC.workload.endpoints


def test_every_batch_token_is_served_at_most_once(result: dict) -> None:
    for v in result["variants"].values():
        for s in v["scenarios"].values():
            served = s["batch_tokens_backfilled"] + s["batch_tokens_on_batch_replicas"]
            assert served == pytest.approx(s["batch_tokens_served"], rel=1e-9)
            assert s["batch_tokens_served"] <= s["batch_tokens_submitted"] * (1 + 1e-9)
    bf = result["variants"]["backfill 50 %"]["scenarios"]["backfill 0.5"]
    assert bf["batch_tokens_backfilled"] > 0


def test_backfill_keeps_each_device_under_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch, "DAY_S", 600.0)
    w, service = build(SPEC, 1, TRACES)
    run = _Run(Lever("b", backfill=0.5), SPEC, w, service, nodes=20, seed=1)
    arrivals = Arrivals(w, 1)
    checked = 0
    for k in range(0, 400):
        a, p, g = arrivals.tick(k)
        run.tick(k, a, p, g)
        f, bf = run.fleet, run.backfill
        if bf.pair_load is None or not bf.pair_load.any():
            continue
        on = np.flatnonzero(f.pair_on)
        pd = f.pair_dev[on]
        used = np.bincount(pd, weights=bf.pair_load[on], minlength=len(f.dev_n))
        assert used.max() <= BACKFILL_CAP + 1e-9
        checked += 1
        d = run.demand
        assert np.all(d.served <= d.submitted * (1 + 1e-12) + 1e-6)
    assert checked > 0


def _mix(adapters: int) -> ad.AdapterMix:
    """One shared base unit (0) holding `adapters` adapter endpoints."""
    n = adapters
    return ad.AdapterMix(
        share=1.0,
        unit_of=np.zeros(n, dtype=np.int64),
        is_adapter=np.ones(n, dtype=bool),
        pooled=np.ones(1, dtype=bool),
        unit_model=np.array([3]),
        code_frac=np.zeros(1),
        service=None,  # type: ignore[arg-type]
        load_s=np.ones(1),
    )


def test_adapter_residency_is_lru_over_the_ready_replicas_slots() -> None:
    slots = ad.ADAPTER_SLOTS
    res = ad.Residency(_mix(slots + 1))
    one = np.array([1])
    only = lambda e: np.eye(slots + 1, dtype=np.int64)[e]  # noqa: E731
    assert res.cold(0.0, only(0), np.array([0])).sum() == 0  # base not ready: a replica start
    assert res.cold(2.0, only(0), one)[0] == 1  # first use on a ready base: loaded
    assert res.cold(4.0, only(0), one)[0] == 0  # now resident
    for e in range(1, slots + 1):  # `slots` others push adapter 0 out of the slots
        assert res.cold(4.0 + 2 * e, only(e), one)[e] == 1
    assert res.cold(1000.0, only(0), one)[0] == 1
    assert res.cold(1002.0, only(0), np.array([2]))[0] == 0
    res.cold(1004.0, only(1), np.array([0]))  # the base went to zero: nothing stays loaded
    assert res.cold(1006.0, only(0), one)[0] == 1


def test_batch_jobs_are_served_first_in_first_out_and_judged_on_their_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An hour for a day and for the window keeps the loop short; the rules are the same.
    monkeypatch.setattr(batch, "DAY_S", 3600.0)
    monkeypatch.setattr(batch, "WINDOW_S", 3600.0)
    monkeypatch.setattr(batch, "ASAP_S", 600.0)
    w, service = build(SPEC, 2, TRACES)
    mix = ad.build_mix(w, service, 0.0, 2)
    d = BatchDemand(w, mix, 0.5, 2, run_s=2 * 3600.0)
    assert len(d.unit) == 2 * SPEC.workload.endpoints  # one job per endpoint per "day"
    assert np.all(np.diff(d.submit[d.unit == d.unit[0]]) > 0)
    replicas = BatchReplicas(mix, deadline=False, release_delay_s=600.0)
    for k in range(round(2 * 3600 / TICK_S)):
        d.arrive(k)
        replicas.step(k, d, np.zeros(mix.units))
    s = d.summary(2 * 3600.0)
    assert s["batch_jobs_judged"] == SPEC.workload.endpoints  # the first "day"'s jobs
    assert s["batch_windows_met_pct"] == 100.0
    assert replicas.tokens == pytest.approx(s["batch_tokens_served"])
    assert s["batch_tokens_served"] <= s["batch_tokens_submitted"] * (1 + 1e-9)
    # Served in order: a unit's later job never finishes before an earlier one.
    for u in np.unique(d.unit):
        done = d.done_at[d.unit == u]
        assert np.all(np.diff(done[np.isfinite(done)]) >= 0)
    assert Backfill(mix).preempt_s.min() > 0
