"""Batch demand with 24-hour windows, and the two ways it is served: backfill and batch replicas.

Demand (stated): every endpoint submits one batch job a day, at a uniform random time of the
day, whose tokens are `share / (1 - share)` times the real-time tokens its rates are expected to
bring that day (so batch is `share` of the fleet's daily tokens); each job's window is 24 h.
Jobs are drawn from their own generator per seed (the real-time arrivals are unchanged). A job
of an adapter endpoint runs on its shared base (`adapters`). A unit's jobs are served first in,
first out (with one window length, that is earliest deadline first); a job is met when its last
token is served before its deadline; jobs whose deadline falls after the run are not judged.

`Backfill` (issue 25's lever): after real-time serving, each device's time not asked for by
real-time work, up to `BACKFILL_CAP` of the device, goes to the batch work of the ready replicas
on it (shared equally among those with batch pending), at the replica's full-slot speed. It is
the lowest class: the next tick's real-time work takes its share first (preempted batch
sequences are swapped out, `SWAP_BW`); meanwhile the batch work slows the other engines on the
device (time-slicing) and lengthens its own engine's decode steps (`serving.Extra`).

`BatchReplicas`: replicas of the unit's model that run batch work alone at full slots, outside
the real-time fleet (own devices, packed 8 to a node). Without backfill they start as soon as a
job is pending (as many as finish the pending work in `ASAP_S`, the platform's batch scaling its
endpoint up today); with backfill only when the deadline needs them: when the rate that finishes
every pending job `DEADLINE_MARGIN_S` before its deadline exceeds what backfill has recently
delivered by a whole replica's rate (a replica is started at the latest moment it must run
without a break). Each start pays the model's cold start (node cache) before it serves.
"""

from __future__ import annotations

import math

import numpy as np

from fleetsim.adapters import AdapterMix
from fleetsim.service import CATALOGUE, DEVICES_PER_NODE, SLOT_TOKENS
from fleetsim.workload import DAY_S, TICK_S, Workload

WINDOW_S = 86400.0
BACKFILL_CAP = 0.8  # device share real-time + backfill may reach
SWAP_BW = 25e9  # bytes/s, device -> host RAM (PCIe 4 x16, achieved)
ASAP_S = 3600.0
DEADLINE_MARGIN_S = 4 * 3600.0
MAX_BATCH_REPLICAS = 64
RATE_HALF_LIFE_S = 3600.0


class BatchDemand:
    """Jobs per unit, what has been submitted and served, and when each job finished."""

    def __init__(self, w: Workload, mix: AdapterMix, share: float, seed: int, run_s: float):
        rng = np.random.default_rng([seed, 41])
        n, ndays = len(w.endpoints.model), math.ceil(run_s / DAY_S - 1e-9)
        tokens_per_req = w.mean_prompt + w.mean_generated
        per_day = np.zeros((ndays, n))
        sample = 30  # ticks: a minute
        for d in range(ndays):
            for k in range(round(d * DAY_S / TICK_S), round((d + 1) * DAY_S / TICK_S), sample):
                per_day[d] += w.rates(k) * TICK_S * sample
        b = share / (1.0 - share) if share < 1 else 0.0
        ep = np.repeat(np.arange(n)[None, :], ndays, axis=0).ravel()
        submit = (np.arange(ndays)[:, None] * DAY_S + rng.random((ndays, n)) * DAY_S).ravel()
        tokens = (b * per_day * tokens_per_req[None, :]).ravel()
        keep = (tokens > 0) & (submit < run_s)
        unit = mix.unit_of[ep[keep]]
        order = np.lexsort((submit[keep], unit))
        self.unit, self.submit, self.tokens = unit[order], submit[keep][order], tokens[keep][order]
        self.units = mix.units
        # Cumulative tokens of each unit's jobs up to and including each job.
        cum = np.cumsum(self.tokens)
        first = np.searchsorted(self.unit, self.unit, side="left")
        self.cum = cum - np.concatenate([[0.0], cum])[first]
        self.deadline = self.submit + WINDOW_S
        self.submit_tick = np.ceil(self.submit / TICK_S - 1e-9).astype(np.int64)
        self.submitted = np.zeros(self.units)
        self.served = np.zeros(self.units)
        self.done_at = np.full(len(self.unit), np.inf)
        self.arrived = np.zeros(len(self.unit), dtype=bool)
        by_tick: dict[int, list[int]] = {}
        for j, k in enumerate(self.submit_tick.tolist()):
            by_tick.setdefault(k, []).append(j)
        self._by_tick = {k: np.array(v) for k, v in by_tick.items()}

    def arrive(self, tick: int) -> None:
        jobs = self._by_tick.get(tick)
        if jobs is not None:
            self.arrived[jobs] = True
            np.add.at(self.submitted, self.unit[jobs], self.tokens[jobs])

    @property
    def pending(self) -> np.ndarray:
        return np.maximum(0.0, self.submitted - self.served)

    def take(self, tokens: np.ndarray, now: float) -> np.ndarray:
        """Serve up to `tokens` per unit of pending work; returns what was served."""
        got = np.minimum(self.pending, np.maximum(tokens, 0.0))
        if got.any():
            self.served += got
            fresh = self.arrived & np.isinf(self.done_at)
            done = fresh & (self.served[self.unit] >= self.cum * (1 - 1e-12) - 1e-6)
            self.done_at[done] = now + TICK_S
        return got

    def required_rate(self, now: float) -> np.ndarray:
        """Per unit: tokens/s that finish every pending job `DEADLINE_MARGIN_S` early."""
        open_ = self.arrived & np.isinf(self.done_at)
        out = np.zeros(self.units)
        if open_.any():
            j = np.flatnonzero(open_)
            rem = self.cum[j] - self.served[self.unit[j]]
            left = np.maximum(self.deadline[j] - now - DEADLINE_MARGIN_S, TICK_S)
            np.maximum.at(out, self.unit[j], rem / left)
        return out

    def summary(self, end_s: float) -> dict[str, float]:
        judged = self.deadline <= end_s
        met = judged & (self.done_at <= self.deadline)
        return {
            "batch_jobs": len(self.unit),
            "batch_jobs_judged": int(judged.sum()),
            "batch_windows_met_pct": 100 * float(met.sum()) / max(int(judged.sum()), 1),
            "batch_tokens_submitted": float(self.submitted.sum()),
            "batch_tokens_served": float(self.served.sum()),
        }


class BatchReplicas:
    """Replicas that run batch work alone, outside the real-time fleet; `deadline` mode starts
    them only when backfill falls behind a job's deadline."""

    def __init__(self, mix: AdapterMix, deadline: bool, release_delay_s: float) -> None:
        s = mix.service
        self.s, self.deadline = s, deadline
        self.rate = (s.mean_prompt + s.mean_generated) / s.dev_s_full  # tokens/s, full slots
        self.cold = np.array([s.cold_start_s(u, True, 1.0) for u in range(mix.units)])
        self.loading: list[tuple[float, int]] = []  # (ready at, unit)
        self.ready = np.zeros(mix.units, dtype=np.int64)
        self.starting = np.zeros(mix.units, dtype=np.int64)
        self.backfill_rate = np.zeros(mix.units)
        self.keep = max(1, round(release_delay_s / TICK_S))
        self.nodes_ring = np.zeros(self.keep, dtype=np.int64)
        self.tokens = self.capacity_s = self.device_s = self.node_s = 0.0
        self.peak_devices = self.peak_nodes = 0
        self.starts = 0

    def step(self, tick: int, demand: BatchDemand, backfilled: np.ndarray) -> None:
        now = tick * TICK_S
        a = 1.0 - 0.5 ** (TICK_S / RATE_HALF_LIFE_S)
        self.backfill_rate += a * (backfilled / TICK_S - self.backfill_rate)
        while self.loading and self.loading[0][0] <= now:
            _, u = self.loading.pop(0)
            if self.starting[u] > 0:
                self.starting[u] -= 1
                self.ready[u] += 1
        pending = demand.pending
        if self.deadline:
            # Latest start: a replica starts once one running from now to the deadline (less
            # the margin) is needed in full; the margin covers the rest and its cold start.
            short = np.maximum(0.0, demand.required_rate(now) - self.backfill_rate)
            want = np.floor(short / self.rate)
        else:
            want = np.ceil(pending / (self.rate * ASAP_S) - 1e-9)
        want = np.where(pending > 0, np.minimum(want, MAX_BATCH_REPLICAS), 0).astype(np.int64)
        have = self.ready + self.starting
        for u in np.flatnonzero(want > have).tolist():
            for _ in range(int(want[u] - have[u])):
                self.loading.append((now + float(self.cold[u]), u))
            self.starting[u] += int(want[u] - have[u])
            self.starts += int(want[u] - have[u])
        self.loading.sort()
        drop = want < have  # fewer needed: drop loading ones first, then ready ones
        if drop.any():
            extra = np.where(drop, have - want, 0)
            cut = np.minimum(extra, self.starting)
            self.starting -= cut
            self.ready -= extra - cut
        served = demand.take(self.ready * self.rate * TICK_S, now)
        self.tokens += float(served.sum())
        held = self.ready + self.starting
        devices = int((held * self.s.tp).sum())
        # Same definition as the fleet: each device counts its replica's full-slot tokens/s.
        self.capacity_s += float((held * self.s.tp * self.s.capacity).sum()) * TICK_S
        self.device_s += devices * TICK_S
        self.nodes_ring[tick % self.keep] = math.ceil(devices / DEVICES_PER_NODE)
        nodes = int(self.nodes_ring.max())  # a node is released after the delay, empty
        self.node_s += nodes * TICK_S
        self.peak_devices = max(self.peak_devices, devices)
        self.peak_nodes = max(self.peak_nodes, nodes)


class Backfill:
    """Batch work in the idle device time of a fleet's ready real-time replicas."""

    def __init__(self, mix: AdapterMix) -> None:
        s = mix.service
        self.s = s
        self.rate = (s.mean_prompt + s.mean_generated) / s.dev_s_full
        kv = np.array([CATALOGUE[m].kv_bytes_per_token for m in mix.unit_model]) / s.tp
        self.preempt_s = SLOT_TOKENS * kv / SWAP_BW
        self.pair_load: np.ndarray | None = None
        self.batch_seqs = np.zeros(mix.units)
        self.tokens = 0.0

    def step(self, f, u_rt: np.ndarray, demand: BatchDemand, now: float) -> np.ndarray:
        """Serve batch in the free device time of this tick; returns tokens per unit."""
        on = np.flatnonzero(f.pair_on)
        pe, pd = f.pair_ep[on], f.pair_dev[on]
        nd = len(f.dev_n)
        load = np.bincount(pd, weights=u_rt[pe], minlength=nd)
        free = np.maximum(0.0, BACKFILL_CAP - load)
        pending = demand.pending
        cand = pending[pe] > 0
        n_cand = np.bincount(pd[cand], minlength=nd)
        share = np.where(cand, free[pd] / np.maximum(n_cand[pd], 1), 0.0)
        units = len(pending)
        tp = self.s.tp[pe]
        potential = np.bincount(pe, weights=share / tp, minlength=units) * self.rate * TICK_S
        got = demand.take(potential, now)
        scale = np.divide(got, potential, out=np.zeros(units), where=potential > 0)
        used = share * scale[pe]
        self.pair_load = np.zeros(len(f.pair_on))
        self.pair_load[on] = used
        per_replica = np.bincount(pe, weights=used / tp, minlength=units)
        self.batch_seqs = self.s.slots * per_replica / np.maximum(f.ready, 1)
        self.tokens += float(got.sum())
        return got
