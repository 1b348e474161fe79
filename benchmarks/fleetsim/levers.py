"""One seed of the levers' sweep: shared-base adapters, batch backfill, batch replicas, in lockstep.

Every fleet here is the `autoscaled` fleet of `variants` (the platform's defaults) on the same
arrivals as `runner.run_seed`, with its own generator seeded as variant 0 there: a fleet with
no adapters and no backfill is, figure for figure, the autoscaled column of `fleet_sim.py`.
A `Lever` names what it changes:

- `adapters`: the share of endpoints served as adapters on shared base replicas (`adapters`);
- `backfill`: the batch share whose work backfills the fleet's idle device time, with batch
  replicas only when a deadline needs them (`batch.Backfill`, `batch.BatchReplicas`);
- `asap`: batch shares served without backfill, as the platform does today (batch replicas
  started as soon as work is pending); they never touch the real-time fleet, so each is
  accounted beside the fleet without changing it (`overlays`).

Elastic nodes and spot prices change what is paid for, not what runs: `figures` returns the
node-hours of both a static pool (the run's peak nodes all along, today's fixed `devices`
list) and elastic nodes (a node released once empty for the release delay), split into the
real-time fleet's and the batch replicas' (which may run on spot nodes); `levers_report`
prices them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetsim.adapters import AdapterMix, Residency, UnitWorkload, build_mix
from fleetsim.batch import Backfill, BatchDemand, BatchReplicas
from fleetsim.fleet import Fleet
from fleetsim.metrics import Counters
from fleetsim.runner import RunSpec, build, pool_nodes, static_replicas
from fleetsim.serving import Extra, serve
from fleetsim.trace import Trace
from fleetsim.variants import BASE
from fleetsim.workload import DAY_S, TICK_S, Arrivals


@dataclass(frozen=True)
class Lever:
    name: str
    adapters: float = 0.0
    backfill: float = 0.0  # batch share served by backfill (0: no batch in the fleet)
    asap: tuple[float, ...] = ()  # batch shares accounted without backfill, beside the fleet


class _Run:
    """One lever's fleet and what it adds to the plain tick."""

    def __init__(self, lever: Lever, spec: RunSpec, w, service, nodes: int, seed: int) -> None:
        self.lever = lever
        self.mix: AdapterMix = build_mix(w, service, lever.adapters, seed)
        pooled = bool(self.mix.pooled.any())
        # The same pool of nodes as without adapters (placement spreads an endpoint's replicas
        # over the nodes it is given, so a larger pool would change node-hours by itself).
        self.fleet = Fleet(lever.name, BASE, self.mix.service, nodes)
        self.rng = np.random.default_rng([seed, 11, 0])
        self.view = UnitWorkload(w, self.mix) if pooled else w
        # A shared base is one endpoint: one admission queue (256) for all its adapters.
        self.residency = Residency(self.mix) if pooled else None
        self.mean_prompt = w.mean_prompt
        self.adapter_cold = 0.0
        delay = BASE.release_delay_s
        self.demand = self.backfill = self.replicas = None
        if lever.backfill > 0:
            self.demand = BatchDemand(w, self.mix, lever.backfill, seed, spec.days * DAY_S)
            self.backfill = Backfill(self.mix)
            self.replicas = BatchReplicas(self.mix, deadline=True, release_delay_s=delay)
        self.overlays = [
            (share, BatchDemand(w, self.mix, share, seed, spec.days * DAY_S),
             BatchReplicas(self.mix, deadline=False, release_delay_s=delay))
            for share in lever.asap
        ]  # fmt: skip

    def tick(self, k: int, a: np.ndarray, p: np.ndarray, g: np.ndarray) -> None:
        f, mix, now = self.fleet, self.mix, k * TICK_S
        au, pu, gu = mix.aggregate(a), mix.aggregate(p), mix.aggregate(g)
        f.begin_tick(k)
        f.activate(k, au, self.rng)
        extra = None
        cold_e = None
        if self.residency is not None:
            cold_e = self.residency.cold(now, a, f.ready)
            excl = np.bincount(self.residency.unit, weights=cold_e, minlength=mix.units)
            extra = Extra(warm_exclude=excl)
        if self.backfill is not None and self.backfill.pair_load is not None:
            extra = extra or Extra()
            extra.pair_load = self.backfill.pair_load
            extra.batch_seqs = self.backfill.batch_seqs
            extra.preempt_s = self.backfill.preempt_s
        st = serve(f, self.view, k, au, pu, gu, self.rng, extra)
        if cold_e is not None and cold_e.any():
            self._adapter_cold(cold_e, st)
        if k >= 0 and self.demand is not None:
            self.demand.arrive(k)
            got = self.backfill.step(f, st.u, self.demand, now)
            f.counters.tokens += float(got.sum())
            self.replicas.step(k, self.demand, got)
        if k >= 0:
            for _, demand, replicas in self.overlays:
                demand.arrive(k)
                replicas.step(k, demand, np.zeros(mix.units))
        f.control(k, au)

    def _adapter_cold(self, cold_e: np.ndarray, st) -> None:
        """TTFT of requests that wait for their adapter: its load, then as a warm request."""
        j = np.flatnonzero(cold_e)
        e, u = self.residency.idx[j], self.residency.unit[j]
        S = self.mix.service
        wait = self.mix.load_s[u] + st.backlog[u] / np.maximum(st.mu[u], 1e-9)
        ttft = wait + st.slow[u] * (S.pf0[u] + S.pf1[u] * self.mean_prompt[e]) + st.step[u] / 2
        self.fleet.counters.sample(ttft, wait, cold_e[j], cold=True)
        self.adapter_cold += float(cold_e[j].sum())

    def reset(self) -> None:
        f = self.fleet
        f.counters = Counters.for_delays(f.policy.release_delay_s, self.mix.units)
        self.adapter_cold = 0.0

    def figures(self, seconds: float) -> dict[str, Any]:
        c = self.fleet.counters
        out = c.summary(seconds)
        pooled = self.mix.pooled
        out["by_group"] = c.by_group({
            "own endpoints": np.flatnonzero(~pooled), "shared bases": np.flatnonzero(pooled)
        })  # fmt: skip
        out["units"] = self.mix.units
        out["adapter_cold_pct"] = 100 * self.adapter_cold / max(c.requests, 1)
        out["cold_or_adapter_pct"] = out["cold_request_pct"] + out["adapter_cold_pct"]
        if self.residency is not None:
            out["adapter_load_s_8b"] = float(
                self.mix.load_s[np.flatnonzero(self.mix.unit_model == 3)].max(initial=0.0)
            )
        row = c.by_delay[c.release_delay_s]
        rt = {"device_s": row[0], "node_s": row[1], "capacity_s": row[2], "peak_nodes": row[4]}
        rt["tokens"] = c.tokens
        scen = {}
        if self.demand is not None:
            scen[f"backfill {self.lever.backfill:g}"] = _scenario(
                rt, self.replicas, self.demand, seconds, self.backfill.tokens
            )
        for share, demand, replicas in self.overlays:
            scen[f"asap {share:g}"] = _scenario(rt, replicas, demand, seconds, 0.0)
        out["scenarios"] = scen
        return out


def _scenario(rt: dict, r: BatchReplicas, d: BatchDemand, seconds: float, backfilled: float):
    """The fleet plus its batch work: utilization, devices, nodes (static and elastic)."""
    h = seconds / 3600
    tokens = rt["tokens"] + r.tokens
    served = backfilled + r.tokens
    return d.summary(seconds) | {
        "token_slot_utilization_pct": 100 * tokens / max(rt["capacity_s"] + r.capacity_s, 1e-9),
        "device_hours": (rt["device_s"] + r.device_s) / 3600,
        "rt_node_hours_elastic": rt["node_s"] / 3600,
        "rt_node_hours_static": rt["peak_nodes"] * h,
        "batch_node_hours_elastic": r.node_s / 3600,
        "batch_node_hours_static": r.peak_nodes * h,
        "batch_tokens_backfilled": backfilled,
        "batch_tokens_on_batch_replicas": r.tokens,
        "batch_share_of_tokens_pct": 100 * served / max(tokens, 1e-9),
        "batch_replica_starts": r.starts,
    }


def run_levers(
    spec: RunSpec,
    seed: int,
    levers: list[Lever],
    progress: Callable[[int], None] | None = None,
    traces: dict[str, Trace] | None = None,
) -> dict[str, Any]:
    started = time.process_time()
    w, service = build(spec, seed, traces)
    ticks = round(spec.days * 86400 / TICK_S)
    warm = round(spec.warmup_s / TICK_S)
    nodes = pool_nodes(service, static_replicas(w, service, ticks, spec.static_target))
    runs = [_Run(lever, spec, w, service, nodes, seed) for lever in levers]
    arrivals = Arrivals(w, seed)
    for k in range(-warm, ticks):
        if k == 0:
            for r in runs:
                r.reset()
        a, p, g = arrivals.tick(k)
        for r in runs:
            r.tick(k, a, p, g)
        if progress is not None and (k + warm) % 500 == 499:
            progress(500)
    seconds = ticks * TICK_S
    return {
        "seed": seed,
        "pool_nodes": nodes,
        "cpu_s": round(time.process_time() - started, 1),
        "variants": {r.lever.name: r.figures(seconds) for r in runs},
    }
