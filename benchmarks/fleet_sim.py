"""The real autoscaler and placement on a simulated fleet, against an always-on static baseline.

    python benchmarks/fleet_sim.py [--endpoints 1000] [--days 2] [--seed 0] [--json out.json]
        [--metric concurrency|gpu_utilization|mixed] [--target 70] [--scale-down-delay 30]
        [--scale-down packing|newest] [--cells 2]

`modelyard.control.autoscaler.Autoscaler` decides every endpoint's replica count every 2
simulated seconds and `modelyard.control.placement.Placement` puts new replicas on devices; both
are imported, not copied. A simulated clock drives everything (no sleeping, no threads). The
same arrivals hit, in the same run, a static fleet where every endpoint keeps the replicas its
own peak needs, always on. Targets: autoscaled mean (engine-busy) utilization > 70 %, fewer
device-hours than static, SLO misses reported. Prints JSON, then a table.

Assumptions (the model, stated so the numbers can be judged):

- Fleet: 80 GiB devices, 8 per node. The pool has as many nodes as the static fleet needs plus
  20 %; both fleets get the same pool and both are placed by `Placement`. A replica that does
  not fit is an unschedulable event; the autoscaler asks again on its next tick, and each
  attempt counts. With `--cells N` (default 2, one process per core) the endpoints are split
  round-robin into N independent cells, each with its own pool; the numbers add up.
- Endpoints: 70 % small (replica 1.3-4 GiB: weights 0.3-2 GiB, KV budget 0.5-1.5 GiB, 64-256 MiB
  of KV per request), 25 % medium (10-20 GiB: weights 4-10 GiB, KV 5-9.5 GiB, 0.5-1.5 GiB per
  request), 5 % large (2-4 devices of 60-76 GiB each: weights 25-45 GiB per device, the rest KV,
  2-8 GB per request as in the spec). Every replica also holds 512 MiB overhead per device. Its
  concurrency limit C is the spec's admission formula, `placement.max_concurrency`.
- Service: a request holds one of its replica's C slots for 2-4 s (small), 2-6 s (medium) or
  4-12 s (large), in whole 2 s ticks; with continuous batching the time does not depend on how
  full the replica is. An endpoint's replicas pool their slots (least-loaded routing). Traffic
  is aggregated per 2 s tick and endpoint (Poisson counts), not simulated request by request;
  waits are measured in ticks: a request that waits more than one tick for a slot (over 2 s,
  the SLO's slack on top of its service time) is an SLO miss.
- Cold start: a new replica is ready after 20 s when its node's artifact cache (LRU, 2 TiB per
  node) holds the model, else 60 s. A request that arrives while its endpoint has no ready
  replica is a cold start request; it waits in the queue like the others.
- Traffic, per endpoint: 65 % diurnal: a daily sine (amplitude 0.3-0.95, peak hour around 14:00
  with a spread of time zones), weekends at 20-100 % of weekdays (day 0 is a Friday). The peak
  load, in replicas at 100 % of C, is log-normal (median 0.8, capped at 40; 8 for large
  models): most endpoints need less than one replica, a few need dozens. Bursts arrive as a
  Poisson process (0.5-4 a day, 1-30 min) and add load (log-normal, median 1 replica, capped at
  16) on top: a client's eval job adds about as much to a big endpoint as to a small one. 35 %
  are mostly idle: nothing but sessions (1-12 a day, 1-60 min, 0.05-2 replicas of load), so
  they sit at zero between sessions. The run starts with an uncounted hour of warm-up.
- Autoscaling, as the endpoint manager drives it: the spec's policy for every endpoint (min 1
  replica, scale to zero after 300 s idle, max 2x the static count, stable/panic windows
  60 s / 6 s, scale-down delay 30 s). A request for an endpoint with nothing serving starts one
  replica; no decision is taken until a replica serves. Metrics as `control/scaling.py` computes
  them: `concurrency` = requests in flight + queued (target 70 % of C per replica);
  `gpu_utilization` = the engines' busy fractions summed, an engine being busy while it has any
  request (target 70); `mixed` gives each endpoint one of the two at random. A scale-down drops the
  replicas the endpoint manager's own `scale_down_order` names: starting ones first, then the
  ready ones whose removal empties devices (`Placement.drain_order`); `--scale-down newest`
  drops the newest ready ones instead, for comparison. A dropped ready replica drains
  for one service time before its memory is freed.
- Static baseline: per endpoint, ceil(peak concurrency / (70 % of C)) replicas, the peak being
  the diurnal peak plus its largest burst (or overlapping sessions); placed once, ready from
  the start, never scaled.
- Utilization, two ways, both over provisioned device-seconds (a device is provisioned while
  any replica, loading, ready or draining, occupies it):
  * engine-busy: the issue's `gpu_utilization`, an engine's busy fraction (it steps while it
    has any request), carried onto shared devices by memory: a stepping replica counts the
    device memory it holds, an idle or loading one counts nothing. Target: > 70 %.
  * memory bandwidth, the stricter view, since decode is bandwidth-bound: a device is fully
    busy when every step streams all of its memory. A stepping replica streams its weights,
    its KV cache in proportion to the slots in use; overhead never counts.
  (Busy time as nvidia-smi counts it, any kernel running, would read higher than both and say
  less: one request in flight keeps a device "100 % busy".)

Run time: the real `Autoscaler.decide` averages its windows from the raw samples (8-13 us a
decision here), and 1,000 endpoints over 2 days, one decision per 2 s for every endpoint with a
serving replica, come to about 60 million decisions: 8-13 CPU minutes, nine tenths of them in
the autoscaler, so 5-10 minutes on 2 cores. `--endpoints 200 --days 1` takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import OrderedDict, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from modelyard.control.autoscaler import Autoscaler, Observation, ScalingPolicy
from modelyard.control.devices import Device, inventory
from modelyard.control.placement import (
    DEFAULT_OVERHEAD_BYTES,
    GiB,
    Placement,
    ReplicaRequest,
    max_concurrency,
    replica_memory,
)
from modelyard.control.replicas import scale_down_order
from modelyard.control.state import Replica

TICK_S = 2.0
DAY_TICKS = int(86400 / TICK_S)
DEVICE_BYTES = 80 * GiB
DEVICES_PER_NODE = 8
COLD_CACHED_S = 20.0
COLD_REMOTE_S = 60.0
NODE_CACHE_BYTES = 2048 * GiB
POOL_HEADROOM = 1.2
WARMUP_TICKS = int(3600 / TICK_S)
MiB = 2**20


@dataclass(frozen=True)
class Knobs:
    """The policy knobs a run can vary."""

    metric: str = "concurrency"  # concurrency | gpu_utilization | mixed
    target: float = 0.7  # per replica: 70 % of C in flight, or 70 % busy
    scale_down_delay_s: float = 30.0
    scale_down: str = "packing"  # which ready replica goes: packing (as the platform) | newest


@dataclass
class Fleet:
    """The endpoints, one array entry each (numpy, so a tick is a handful of vector ops)."""

    size: np.ndarray  # 0 small, 1 medium, 2 large
    devices: np.ndarray  # devices per replica
    mem_dev: np.ndarray  # bytes per device
    w_dev: np.ndarray  # weights bytes per device
    kv_dev: np.ndarray  # KV budget bytes per device
    conc: np.ndarray  # C, requests in flight per replica
    service_ticks: np.ndarray
    idle: np.ndarray  # mostly idle (sessions only)
    peak_rate: np.ndarray  # requests/s at the weekday diurnal peak, before bursts
    amp: np.ndarray
    peak_hour: np.ndarray
    weekend: np.ndarray
    static_replicas: np.ndarray
    metric: list[str]
    knobs: Knobs
    extra_events: dict[int, list[tuple[int, float]]]  # tick -> [(endpoint, +/- requests/s)]

    def subset(self, idx: np.ndarray) -> Fleet:
        """The endpoints `idx`, renumbered 0..len(idx)-1."""
        new = {int(old): i for i, old in enumerate(idx)}

        def events(src: dict[int, list[tuple[int, float]]]) -> dict[int, list[tuple[int, float]]]:
            out: dict[int, list[tuple[int, float]]] = {}
            for tick, items in src.items():
                kept = [(new[e], v) for e, v in items if e in new]
                if kept:
                    out[tick] = kept
            return out

        arrays = {
            name: getattr(self, name)[idx]
            for name in self.__dataclass_fields__
            if isinstance(getattr(self, name), np.ndarray)
        }
        return Fleet(
            **arrays,
            metric=[self.metric[int(i)] for i in idx],
            knobs=self.knobs,
            extra_events=events(self.extra_events),
        )


def build_fleet(n: int, days: int, rng: np.random.Generator, knobs: Knobs) -> Fleet:
    size = rng.choice(3, size=n, p=[0.70, 0.25, 0.05])
    devices = np.where(size == 2, rng.integers(2, 5, size=n), 1)
    w = np.select(
        [size == 0, size == 1],
        [rng.uniform(0.3, 2.0, n), rng.uniform(4, 10, n)],
        rng.uniform(25, 45, n),
    )
    large_mem = rng.uniform(60, 76, n)
    kv = np.select(
        [size == 0, size == 1],
        [rng.uniform(0.5, 1.5, n), rng.uniform(5, 9.5, n)],
        large_mem - w - DEFAULT_OVERHEAD_BYTES / GiB,
    )
    per_request = np.select(
        [size == 0, size == 1],
        [rng.uniform(64, 256, n) * MiB, rng.uniform(0.5, 1.5, n) * GiB],
        rng.uniform(2, 8, n) * 1e9,
    )
    w_dev = (w * GiB).astype(np.int64)
    kv_dev = (kv * GiB).astype(np.int64)
    mem_dev = np.array([replica_memory(int(a), int(b)) for a, b in zip(w_dev, kv_dev, strict=True)])
    conc = np.array(
        [
            max_concurrency(int(m * k), int((m - kvb) * k), int(r))
            for m, kvb, k, r in zip(mem_dev, kv_dev, devices, per_request, strict=True)
        ]
    )
    service_s = np.select(
        [size == 0, size == 1],
        [rng.choice([2, 4], n), rng.choice([2, 4, 6], n)],
        rng.choice([4, 6, 8, 10, 12], n),
    )
    service_ticks = np.maximum(1, np.round(service_s / TICK_S)).astype(np.int64)

    idle = rng.random(n) < 0.35
    load = np.minimum(rng.lognormal(math.log(0.8), 1.2, n), np.where(size == 2, 8.0, 40.0))
    peak_rate = np.where(idle, 0.0, load * conc / (service_ticks * TICK_S))
    amp = rng.uniform(0.3, 0.95, n)
    peak_hour = (rng.normal(14, 3, n) + rng.choice([0, -6, 8], n, p=[0.6, 0.25, 0.15])) % 24
    weekend = rng.uniform(0.2, 1.0, n)

    ticks = days * DAY_TICKS
    # Bursts and sessions add requests/s on top of the diurnal rate, from start to end tick:
    # a client's eval job or a demo adds about the same load to a big endpoint as to a small one.
    extra_events: dict[int, list[tuple[int, float]]] = defaultdict(list)
    peak_extra = np.zeros(n)
    for e in range(n):
        per_day, mean_s, cap_s = (
            (rng.uniform(1, 12), 600, 3600) if idle[e] else (rng.uniform(0.5, 4), 300, 1800)
        )
        spans = []
        for _ in range(rng.poisson(per_day * days)):
            start = int(rng.integers(0, ticks))
            length = int(np.clip(rng.exponential(mean_s), 60, cap_s) / TICK_S)
            level = rng.uniform(0.05, 2.0) if idle[e] else min(rng.lognormal(0.0, 1.0), 16.0)
            rate = level * conc[e] / (service_ticks[e] * TICK_S)
            extra_events[start].append((e, rate))
            extra_events[start + length].append((e, -rate))
            spans.append((start, start + length, rate))
        peak_extra[e] = _peak_overlap(spans)

    target_conc = knobs.target * conc
    # Static provisioning for the peak: the diurnal peak with the largest burst on top of it.
    peak_conc = (peak_rate + peak_extra) * service_ticks * TICK_S
    static_replicas = np.maximum(1, np.ceil(peak_conc / target_conc - 1e-9)).astype(np.int64)
    if knobs.metric == "mixed":
        metrics = [["concurrency", "gpu_utilization"][i] for i in rng.integers(0, 2, n)]
    else:
        metrics = [knobs.metric] * n
    return Fleet(
        size=size,
        devices=devices,
        mem_dev=mem_dev,
        w_dev=w_dev,
        kv_dev=kv_dev,
        conc=conc,
        service_ticks=service_ticks,
        idle=idle,
        peak_rate=peak_rate,
        amp=amp,
        peak_hour=peak_hour,
        weekend=weekend,
        static_replicas=static_replicas,
        metric=metrics,
        knobs=knobs,
        extra_events=dict(extra_events),
    )


def _peak_overlap(sessions: list[tuple[int, int, float]]) -> float:
    """The highest summed rate of overlapping sessions."""
    edges = sorted([(s, r) for s, _, r in sessions] + [(e, -r) for _, e, r in sessions])
    level = peak = 0.0
    for _, r in edges:
        level += r
        peak = max(peak, level)
    return peak


GROUPS = ("mostly idle", "peak < 1 replica", "peak 1-4 replicas", "peak >= 4 replicas")


def group_of(fleet: Fleet) -> np.ndarray:
    """Each endpoint's group: mostly idle, else by its diurnal peak in replicas at 100 % of C."""
    load = fleet.peak_rate * fleet.service_ticks * TICK_S / fleet.conc
    return np.where(fleet.idle, 0, np.where(load < 1, 1, np.where(load < 4, 2, 3)))


def pool(nodes: int) -> list[Device]:
    spec = f"cuda:{DEVICES_PER_NODE}x{DEVICE_BYTES}"
    return [d for i in range(nodes) for d in inventory(spec, node=f"n{i:04d}")]


def static_requests(fleet: Fleet) -> list[ReplicaRequest]:
    return [
        ReplicaRequest(f"s{e}-{i}", str(e), int(fleet.mem_dev[e]), int(fleet.devices[e]))
        for e in range(len(fleet.size))
        for i in range(int(fleet.static_replicas[e]))
    ]


@dataclass
class Serving:
    """Queue and slots of every endpoint of one fleet; `step` serves one tick."""

    n: int
    ring_len: int
    ring: np.ndarray = field(init=False)
    in_service: np.ndarray = field(init=False)
    q0: np.ndarray = field(init=False)  # arrived this tick
    q1: np.ndarray = field(init=False)  # waited one tick: still within the SLO
    q2: np.ndarray = field(init=False)  # waited longer: over the SLO
    _rows: np.ndarray = field(init=False)
    busy_per_endpoint: np.ndarray = field(init=False)  # device-seconds
    allocated_per_endpoint: np.ndarray = field(init=False)
    requests: int = 0
    cold: int = 0
    misses: int = 0
    wait_s: float = 0.0
    busy_device_s: float = 0.0
    engine_busy_device_s: float = 0.0
    provisioned_device_s: float = 0.0
    allocated_device_s: float = 0.0
    starting_device_s: float = 0.0

    def __post_init__(self) -> None:
        self.ring = np.zeros((self.n, self.ring_len), dtype=np.int64)
        self.in_service = np.zeros(self.n, dtype=np.int64)
        self.q0 = np.zeros(self.n, dtype=np.int64)
        self.q1 = np.zeros(self.n, dtype=np.int64)
        self.q2 = np.zeros(self.n, dtype=np.int64)
        self._rows = np.arange(self.n)
        self.busy_per_endpoint = np.zeros(self.n)
        self.allocated_per_endpoint = np.zeros(self.n)

    def step(
        self, t: int, arrivals: np.ndarray, ready: np.ndarray, fleet: Fleet
    ) -> tuple[np.ndarray, np.ndarray]:
        """Serve tick `t`; returns (in flight + queued, in service) per endpoint."""
        slot = t % self.ring_len
        self.in_service -= self.ring[:, slot]
        self.ring[:, slot] = 0
        self.misses += int(self.q1.sum())
        self.q2 += self.q1
        self.q1 = self.q0
        self.q0 = arrivals.copy()
        self.requests += int(arrivals.sum())
        self.cold += int(arrivals[ready == 0].sum())

        free = np.maximum(ready * fleet.conc - self.in_service, 0)
        started = np.zeros(self.n, dtype=np.int64)
        for queue in (self.q2, self.q1, self.q0):  # oldest first
            take = np.minimum(queue, free)
            queue -= take
            free -= take
            started += take
        self.ring[self._rows, (t + fleet.service_ticks) % self.ring_len] += started
        self.in_service += started
        queued = self.q0 + self.q1 + self.q2
        self.wait_s += float(queued.sum()) * TICK_S
        return self.in_service + queued, self.in_service

    def reset_counters(self) -> None:
        self.requests = self.cold = self.misses = 0
        self.wait_s = self.busy_device_s = self.provisioned_device_s = 0.0
        self.engine_busy_device_s = 0.0
        self.allocated_device_s = self.starting_device_s = 0.0
        self.busy_per_endpoint[:] = 0
        self.allocated_per_endpoint[:] = 0

    def totals(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "cold": self.cold,
            "misses": self.misses,
            "wait_s": self.wait_s,
            "busy_device_s": self.busy_device_s,
            "engine_busy_device_s": self.engine_busy_device_s,
            "provisioned_device_s": self.provisioned_device_s,
            "allocated_device_s": self.allocated_device_s,
            "starting_device_s": self.starting_device_s,
        }

    def account(
        self,
        fleet: Fleet,
        hosting: np.ndarray,
        held: np.ndarray,
        occupied: int,
        starting_bytes: int = 0,
    ) -> None:
        """Add one tick of busy, allocated and provisioned device-seconds; `hosting` replicas
        serve (ready or draining), `held` ones occupy memory (also those still loading)."""
        # Weights stream while a replica has any request; KV in proportion to slots in use.
        stepping = np.minimum(hosting, self.in_service)  # replicas with a request in flight
        weights = fleet.w_dev * stepping
        kv = fleet.kv_dev * self.in_service / fleet.conc
        busy = (weights + kv) * fleet.devices * (TICK_S / DEVICE_BYTES)
        allocated = (held * fleet.mem_dev * fleet.devices) * (TICK_S / DEVICE_BYTES)
        self.busy_per_endpoint += busy
        self.allocated_per_endpoint += allocated
        self.busy_device_s += float(busy.sum())
        # The issue's `gpu_utilization` view: an engine is busy while it steps, and a busy
        # engine counts the whole memory share of the device it holds.
        engine_busy = stepping * fleet.mem_dev * fleet.devices * (TICK_S / DEVICE_BYTES)
        self.engine_busy_device_s += float(engine_busy.sum())
        self.allocated_device_s += float(allocated.sum())
        self.provisioned_device_s += occupied * TICK_S
        self.starting_device_s += starting_bytes / DEVICE_BYTES * TICK_S

    def by_group(self, groups: np.ndarray) -> dict[str, list[float]]:
        """Per endpoint group: [endpoints, busy device-s, allocated device-s]."""
        return {
            name: [
                int((groups == i).sum()),
                float(self.busy_per_endpoint[groups == i].sum()),
                float(self.allocated_per_endpoint[groups == i].sum()),
            ]
            for i, name in enumerate(GROUPS)
        }


@dataclass
class Autoscaled:
    """The autoscaled fleet: one real `Autoscaler` per endpoint, replicas through `Placement`."""

    fleet: Fleet
    placement: Placement
    scalers: list[Autoscaler] = field(init=False)
    replicas: list[list[Replica]] = field(init=False)
    current: np.ndarray = field(init=False)  # starting + ready (what the autoscaler counts)
    ready: np.ndarray = field(init=False)
    hosting: np.ndarray = field(init=False)  # ready + draining: still streaming weights
    ready_at: dict[int, list[tuple[int, Replica]]] = field(default_factory=dict)
    drained_at: dict[int, list[tuple[int, str]]] = field(default_factory=dict)
    node_cache: dict[str, OrderedDict[int, int]] = field(default_factory=dict)
    starting_bytes: int = 0  # held by replicas still loading: allocated, not yet serving
    serial: int = 0
    replica_starts: int = 0
    cache_hits: int = 0
    unschedulable: int = 0
    unschedulable_reasons: dict[str, int] = field(default_factory=dict)
    decisions: int = 0

    def __post_init__(self) -> None:
        n = len(self.fleet.size)
        self.scalers = []
        for e in range(n):
            static = int(self.fleet.static_replicas[e])
            gpu = self.fleet.metric[e] == "gpu_utilization"
            fraction = self.fleet.knobs.target
            target = 100 * fraction if gpu else fraction * float(self.fleet.conc[e])
            self.scalers.append(
                Autoscaler(
                    ScalingPolicy(
                        metric=self.fleet.metric[e],
                        target=target,
                        min_replicas=1,
                        max_replicas=max(2, 2 * static),
                        scale_to_zero=True,
                        idle_to_zero_s=300.0,
                        scale_down_delay_s=self.fleet.knobs.scale_down_delay_s,
                    )
                )
            )
        self.replicas = [[] for _ in range(n)]
        self.current = np.zeros(n, dtype=np.int64)
        self.ready = np.zeros(n, dtype=np.int64)
        self.hosting = np.zeros(n, dtype=np.int64)

    def reset_counters(self) -> None:
        self.replica_starts = self.cache_hits = self.unschedulable = self.decisions = 0
        self.unschedulable_reasons = {}

    def begin_tick(self, t: int) -> None:
        for e, replica in self.ready_at.pop(t, []):
            if replica in self.replicas[e] and replica.state != "ready":
                replica.state = "ready"
                self.starting_bytes -= self._bytes(e)
                self.ready[e] += 1
                self.hosting[e] += 1
        for e, replica_id in self.drained_at.pop(t, []):
            self._free(e, replica_id)
            self.hosting[e] -= 1

    def control(self, t: int, arrivals: list[int], demand: list[float], busy: list[float]) -> None:
        """One autoscaler tick, as the endpoint manager runs it.

        A request for an endpoint with nothing serving starts one replica at once and marks the
        endpoint active; nothing is judged until a replica serves (a cold start is no idleness,
        and its backlog is not a steady load). Every other endpoint with replicas gets an
        observation and a decision.
        """
        now = t * TICK_S
        current, ready = self.current, self.ready
        for e in np.flatnonzero((current > 0) | (np.asarray(arrivals) > 0)).tolist():
            cur = int(current[e])
            scaler = self.scalers[e]
            if ready[e] == 0:
                if arrivals[e] > 0:
                    scaler.mark_active(now)
                    if cur == 0:
                        self._scale_up(t, e, 1)
                continue
            value = busy[e] if self.fleet.metric[e] == "gpu_utilization" else demand[e]
            scaler.observe(Observation(now, value, arrivals[e] > 0 or demand[e] > 0))
            desired = scaler.decide(now, cur).desired
            self.decisions += 1
            if desired > cur:
                self._scale_up(t, e, desired - cur)
            elif desired < cur:
                self._scale_down(t, e, cur - desired)

    def _scale_up(self, t: int, e: int, count: int) -> None:
        f = self.fleet
        requests = []
        for _ in range(count):
            self.serial += 1
            requests.append(
                ReplicaRequest(f"r{self.serial}", str(e), int(f.mem_dev[e]), int(f.devices[e]))
            )
        result = self.placement.place(requests)
        for reason in result.unschedulable.values():
            self.unschedulable += 1
            kind = reason.split(";")[0]
            self.unschedulable_reasons[kind] = self.unschedulable_reasons.get(kind, 0) + 1
        for replica_id, devices in result.assignments.items():
            node = devices[0].node
            cache = self.node_cache.setdefault(node, OrderedDict())
            if e in cache:
                cache.move_to_end(e)
                self.cache_hits += 1
                cold_s = COLD_CACHED_S
            else:
                cold_s = COLD_REMOTE_S
                cache[e] = int(f.w_dev[e] * f.devices[e])
                while sum(cache.values()) > NODE_CACHE_BYTES:
                    cache.popitem(last=False)
            ready_tick = t + math.ceil(cold_s / TICK_S)
            replica = Replica(replica_id, placement_id=replica_id, started_at=float(t))
            self.replicas[e].append(replica)
            self.ready_at.setdefault(ready_tick, []).append((e, replica))
            self.current[e] += 1
            self.replica_starts += 1
            self.starting_bytes += self._bytes(e)

    def _scale_down(self, t: int, e: int, count: int) -> None:
        if self.fleet.knobs.scale_down == "packing":
            order = scale_down_order(self.replicas[e], self.placement)
        else:
            order = sorted(self.replicas[e], key=lambda r: (r.state == "ready", -r.started_at))
        for replica in order[:count]:
            self.replicas[e].remove(replica)
            self.current[e] -= 1
            if replica.state == "ready":
                self.ready[e] -= 1
                drain_tick = t + int(self.fleet.service_ticks[e])
                self.drained_at.setdefault(drain_tick, []).append((e, replica.replica_id))
            else:
                self.starting_bytes -= self._bytes(e)
                self._free(e, replica.replica_id)

    def _bytes(self, e: int) -> int:
        return int(self.fleet.mem_dev[e] * self.fleet.devices[e])

    def _free(self, e: int, replica_id: str) -> None:
        self.placement.release(replica_id)


def rates(fleet: Fleet, t: int, extra: np.ndarray) -> np.ndarray:
    """Requests/s of every endpoint during tick `t`."""
    hours = (t * TICK_S / 3600) % 24
    day = t // DAY_TICKS
    shape = (1 + fleet.amp * np.cos(2 * np.pi * (hours - fleet.peak_hour) / 24)) / (1 + fleet.amp)
    week = fleet.weekend if day % 7 in (1, 2) else 1.0  # day 0 is a Friday
    return fleet.peak_rate * shape * week + extra


@dataclass
class Cell:
    """What one cell reports; cells add up."""

    nodes: int
    sizes: list[int]
    idle: int
    auto: dict[str, float]
    static: dict[str, float]
    occupied: np.ndarray  # autoscaled devices provisioned, per tick
    static_devices: int
    replica_starts: int
    cache_hits: int
    unschedulable: int
    reasons: dict[str, int]
    decisions: int
    static_replicas: int
    static_unschedulable: int
    cpu_s: float
    groups_auto: dict[str, list[float]]
    groups_static: dict[str, list[float]]


def run_cell(cell: int, cells: int, endpoints: int, days: int, seed: int, knobs: Knobs) -> Cell:
    """Simulate one cell: every `cells`-th endpoint on its own pool, autoscaled and static."""
    cpu_started = time.process_time()
    whole = build_fleet(endpoints, days, np.random.default_rng(seed), knobs)
    fleet = whole.subset(np.arange(cell, endpoints, cells))
    n = len(fleet.size)
    rng = np.random.default_rng([seed, cells, cell])  # the arrivals both fleets see

    # The pool: what the static fleet needs (placed on an oversized pool first), plus headroom.
    static_bytes = int((fleet.mem_dev * fleet.devices * fleet.static_replicas).sum())
    roomy = Placement(pool(math.ceil(2 * static_bytes / DEVICE_BYTES / DEVICES_PER_NODE) + 1))
    roomy.place(static_requests(fleet))
    nodes = math.ceil(POOL_HEADROOM * roomy.occupied_devices / DEVICES_PER_NODE)
    static_placement = Placement(pool(nodes))
    static_result = static_placement.place(static_requests(fleet))
    static_ready = fleet.static_replicas.copy()
    for replica_id in static_result.unschedulable:
        static_ready[int(replica_id[1:].split("-")[0])] -= 1

    auto = Autoscaled(fleet, Placement(pool(nodes)))
    ring_len = int(fleet.service_ticks.max()) + 1
    auto_serving = Serving(n, ring_len)
    static_serving = Serving(n, ring_len)

    extra = np.zeros(n)
    ticks = days * DAY_TICKS
    occupied = np.zeros(ticks, dtype=np.int32)
    # An hour of warm-up before Friday 00:00, not counted: the fleet should not start from
    # every endpoint cold at once.
    for t in range(-WARMUP_TICKS, ticks):
        if t == 0:
            auto.reset_counters()
            auto_serving.reset_counters()
            static_serving.reset_counters()
        for e, r in fleet.extra_events.get(t, ()):
            extra[e] = max(0.0, extra[e] + r)  # max: float rounding must not go below zero
        arrivals = rng.poisson(rates(fleet, t, extra) * TICK_S)

        auto.begin_tick(t)
        demand, in_service = auto_serving.step(t, arrivals, auto.ready, fleet)
        occupied[max(t, 0)] = auto.placement.occupied_devices
        held = auto.current + auto.hosting - auto.ready  # starting + ready + draining
        auto_serving.account(
            fleet, auto.hosting, held, int(occupied[max(t, 0)]), auto.starting_bytes
        )
        # The engines' busy fraction, summed over ready replicas: an engine steps (is busy)
        # while it has any request, however few (least-loaded routing spreads them).
        busy = np.minimum(auto.ready, in_service).astype(float)
        auto.control(t, arrivals.tolist(), demand.tolist(), busy.tolist())

        static_serving.step(t, arrivals, static_ready, fleet)
        static_serving.account(fleet, static_ready, static_ready, static_placement.occupied_devices)

    return Cell(
        nodes=nodes,
        sizes=np.bincount(fleet.size, minlength=3).tolist(),
        idle=int(fleet.idle.sum()),
        auto=auto_serving.totals(),
        static=static_serving.totals(),
        occupied=occupied,
        static_devices=static_placement.occupied_devices,
        replica_starts=auto.replica_starts,
        cache_hits=auto.cache_hits,
        unschedulable=auto.unschedulable,
        reasons=auto.unschedulable_reasons,
        decisions=auto.decisions,
        static_replicas=int(fleet.static_replicas.sum()),
        static_unschedulable=len(static_result.unschedulable),
        cpu_s=time.process_time() - cpu_started,
        groups_auto=auto_serving.by_group(group_of(fleet)),
        groups_static=static_serving.by_group(group_of(fleet)),
    )


def _summary(totals: dict[str, float], seconds: float, peak: int) -> dict[str, Any]:
    provisioned = totals["provisioned_device_s"]
    return {
        "device_hours": round(provisioned / 3600, 1),
        "mean_devices": round(provisioned / seconds, 1),
        "peak_devices": peak,
        "mean_utilization_pct": round(100 * totals["busy_device_s"] / provisioned, 1),
        "engine_busy_pct": round(100 * totals["engine_busy_device_s"] / provisioned, 1),
        "memory_allocated_pct": round(100 * totals["allocated_device_s"] / provisioned, 1),
        "memory_starting_pct": round(100 * totals["starting_device_s"] / provisioned, 1),
        "requests": int(totals["requests"]),
        "cold_start_requests": int(totals["cold"]),
        "slo_misses": int(totals["misses"]),
        "slo_miss_pct": round(100 * totals["misses"] / max(1, totals["requests"]), 3),
        "mean_queue_wait_s": round(totals["wait_s"] / max(1, totals["requests"]), 3),
    }


def simulate(endpoints: int, days: int, seed: int, knobs: Knobs, cells: int) -> dict[str, Any]:
    started = time.perf_counter()
    args = [(c, cells, endpoints, days, seed, knobs) for c in range(cells)]
    if cells == 1:
        parts = [run_cell(*args[0])]
    else:
        with ProcessPoolExecutor(max_workers=cells) as workers:
            parts = list(workers.map(run_cell, *zip(*args, strict=True)))

    def added(side: str) -> dict[str, float]:
        keys = getattr(parts[0], side).keys()
        return {k: sum(getattr(p, side)[k] for p in parts) for k in keys}

    seconds = days * DAY_TICKS * TICK_S
    reasons: dict[str, int] = {}
    for p in parts:
        for reason, count in p.reasons.items():
            reasons[reason] = reasons.get(reason, 0) + count
    static_devices = sum(p.static_devices for p in parts)
    autoscaled = _summary(added("auto"), seconds, int(sum(p.occupied for p in parts).max())) | {
        "replica_starts": sum(p.replica_starts for p in parts),
        "node_cache_hits": sum(p.cache_hits for p in parts),
        "unschedulable_events": sum(p.unschedulable for p in parts),
        "unschedulable_reasons": reasons,
        "autoscaler_decisions": sum(p.decisions for p in parts),
    }
    static = _summary(added("static"), seconds, static_devices) | {
        "replica_starts": sum(p.static_replicas for p in parts),
        "node_cache_hits": 0,
        "unschedulable_events": sum(p.static_unschedulable for p in parts),
        "unschedulable_reasons": {},
        "autoscaler_decisions": 0,
    }
    nodes = sum(p.nodes for p in parts)
    by_group: dict[str, dict[str, float]] = {}
    for name in GROUPS:
        row: dict[str, float] = {"endpoints": sum(p.groups_auto[name][0] for p in parts)}
        for side, attr in (("autoscaled", "groups_auto"), ("static", "groups_static")):
            busy = sum(getattr(p, attr)[name][1] for p in parts)
            held = sum(getattr(p, attr)[name][2] for p in parts)
            total = sum(sum(g[2] for g in getattr(p, attr).values()) for p in parts)
            row[f"{side}_memory_share_pct"] = round(100 * held / max(total, 1e-9), 1)
            row[f"{side}_busy_of_memory_pct"] = round(100 * busy / max(held, 1e-9), 1)
        by_group[name] = row
    return {
        "endpoints": endpoints,
        "endpoints_by_size": {
            name: sum(p.sizes[i] for p in parts)
            for i, name in enumerate(("small", "medium", "large"))
        },
        "mostly_idle_endpoints": sum(p.idle for p in parts),
        "metric": knobs.metric,
        "target_pct": round(100 * knobs.target),
        "scale_down_delay_s": knobs.scale_down_delay_s,
        "scale_down": knobs.scale_down,
        "seed": seed,
        "cells": cells,
        "simulated_days": days,
        "simulated_hours": days * 24,
        "pool_nodes": nodes,
        "pool_devices": nodes * DEVICES_PER_NODE,
        "autoscaled": autoscaled,
        "static": static,
        "by_group": by_group,
        "device_hours_ratio": round(autoscaled["device_hours"] / static["device_hours"], 3),
        "targets": {
            "engine_busy_utilization_over_70pct": autoscaled["engine_busy_pct"] > 70,
            "fewer_device_hours_than_static": autoscaled["device_hours"] < static["device_hours"],
        },
        "real_seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds_per_cell": [round(p.cpu_s, 1) for p in parts],
    }


ROWS = [
    ("device-hours", "device_hours"),
    ("mean devices provisioned", "mean_devices"),
    ("peak devices provisioned", "peak_devices"),
    ("utilization: engines busy %", "engine_busy_pct"),
    ("utilization: memory bandwidth %", "mean_utilization_pct"),
    ("memory allocated % of provisioned", "memory_allocated_pct"),
    ("  of it held by loading replicas %", "memory_starting_pct"),
    ("requests", "requests"),
    ("cold start requests", "cold_start_requests"),
    ("replica starts", "replica_starts"),
    ("  of them from the node cache", "node_cache_hits"),
    ("requests over the SLO", "slo_misses"),
    ("requests over the SLO %", "slo_miss_pct"),
    ("mean queue wait s", "mean_queue_wait_s"),
    ("unschedulable events", "unschedulable_events"),
]


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['endpoints']} endpoints {report['endpoints_by_size']}, "
        f"{report['mostly_idle_endpoints']} mostly idle; metric {report['metric']}; "
        f"{report['simulated_hours']} simulated hours from a Friday 00:00 on "
        f"{report['pool_nodes']} nodes x {DEVICES_PER_NODE} x 80 GiB in {report['cells']} cell(s); "
        f"target {report['target_pct']} %; seed {report['seed']}; "
        f"{report['real_seconds']} s real time (CPU per cell: {report['cpu_seconds_per_cell']} s)",
        "",
        f"{'':36}{'autoscaled':>14}{'static':>14}",
    ]
    for label, key in ROWS:
        a, s = report["autoscaled"][key], report["static"][key]
        lines.append(f"{label:36}{a:>14,}{s:>14,}")
    lines += [
        "",
        "where the allocated memory goes: share of it, and how busy that share is (%)",
        f"{'':22}{'endpoints':>10}{'auto share':>12}{'busy':>7}{'static share':>14}{'busy':>7}",
    ]
    for name, g in report["by_group"].items():
        lines.append(
            f"{name:22}{g['endpoints']:>10}{g['autoscaled_memory_share_pct']:>12}"
            f"{g['autoscaled_busy_of_memory_pct']:>7}{g['static_memory_share_pct']:>14}"
            f"{g['static_busy_of_memory_pct']:>7}"
        )
    lines.append("")
    lines.append(f"device-hours autoscaled / static: {report['device_hours_ratio']}")
    for name, ok in report["targets"].items():
        lines.append(f"target {name}: {'met' if ok else 'NOT met'}")
    if report["autoscaled"]["unschedulable_reasons"]:
        lines.append(f"unschedulable: {report['autoscaled']['unschedulable_reasons']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--endpoints", type=int, default=1000)
    ap.add_argument("--days", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--metric", choices=["concurrency", "gpu_utilization", "mixed"], default="concurrency"
    )
    ap.add_argument("--target", type=float, default=70, help="per replica target, %% of C / busy")
    ap.add_argument("--scale-down-delay", type=float, default=30, help="seconds (default 30)")
    ap.add_argument(
        "--scale-down",
        choices=["newest", "packing"],
        default="packing",
        help="which ready replica a scale-down drains: the endpoint manager's scale_down_order "
        "(packing: frees whole devices, the default) or the newest (for comparison)",
    )
    ap.add_argument(
        "--cells", type=int, default=2, help="independent pools, one process each (default 2)"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    knobs = Knobs(args.metric, args.target / 100, args.scale_down_delay, args.scale_down)
    report = simulate(args.endpoints, args.days, args.seed, knobs, args.cells)
    print(json.dumps(report, indent=2))
    print()
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
