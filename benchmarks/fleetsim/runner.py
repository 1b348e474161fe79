"""One seed: build its workload and service, then step every variant's fleet in lockstep.

All variants of a seed see the same arrivals (one generator, consumed once per tick); each
fleet has its own generator for what it alone decides (arrival times of its cold requests,
TTFT samples). The first `warmup_s` (1 hour) is simulated but not counted, so that the fleet
does not start with every endpoint cold at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fleetsim.fleet import Fleet
from fleetsim.metrics import Counters
from fleetsim.service import DEVICES, DEVICES_PER_NODE, Service, build_service, host_cost
from fleetsim.serving import serve
from fleetsim.trace import Trace, load_all
from fleetsim.variants import Variant
from fleetsim.workload import TICK_S, Arrivals, Workload, WorkloadSpec, make_endpoints


@dataclass(frozen=True)
class RunSpec:
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    days: float = 2.0
    warmup_s: float = 3600.0
    device: str = "h100"
    trace_dir: Path | None = None
    static_target: float = 0.7


def build(spec: RunSpec, seed: int, traces: dict[str, Trace] | None = None):
    traces = traces or load_all(spec.trace_dir)
    endpoints = make_endpoints(spec.workload, np.random.default_rng([seed, 1]))
    workload = Workload(spec.workload, endpoints, traces)
    service = build_service(
        endpoints.model,
        workload.mean_prompt,
        workload.mean_generated,
        DEVICES[spec.device],
        host_cost(),
    )
    return workload, service


def static_replicas(workload: Workload, service: Service, ticks: int, target: float) -> np.ndarray:
    """Replicas for the 99th percentile rate at `target` of full-slot throughput (at least 1)."""
    p99 = workload.p99_rates(range(0, ticks))
    return np.maximum(1, np.ceil(p99 * service.dev_s_full / target - 1e-9)).astype(np.int64)


def pool_nodes(service: Service, static: np.ndarray) -> int:
    return math.ceil(1.25 * int((static * service.tp).sum()) / DEVICES_PER_NODE) + 2


def run_seed(
    spec: RunSpec,
    seed: int,
    variants: list[Variant],
    progress: Callable[[int], None] | None = None,
    traces: dict[str, Trace] | None = None,
    rng_ids: list[int] | None = None,
) -> dict[str, Any]:
    """`rng_ids`: each variant's own generator (default: its position); a part of a seed's
    variants run alone gives the same figures as in the whole set if it keeps their ids."""
    started = time.process_time()
    workload, service = build(spec, seed, traces)
    ticks = round(spec.days * 86400 / TICK_S)
    warm = round(spec.warmup_s / TICK_S)
    static = static_replicas(workload, service, ticks, spec.static_target)
    nodes = pool_nodes(service, static)
    fleets = [Fleet(v.name, v.policy, service, nodes) for v in variants]
    ids = rng_ids if rng_ids is not None else list(range(len(fleets)))
    rngs = [np.random.default_rng([seed, 11, i]) for i in ids]
    order = np.argsort(-(service.mem_dev * service.tp))
    for v, f in zip(variants, fleets, strict=True):
        if v.static or v.warm_start:
            for e in order.tolist():
                f.scale_up(e, int(static[e]) if v.static else 1, -warm * TICK_S, ready_now=True)
    arrivals = Arrivals(workload, seed)
    for k in range(-warm, ticks):
        if k == 0:
            for f in fleets:
                f.counters = Counters.for_delays(f.policy.release_delay_s, len(static))
        a, p, g = arrivals.tick(k)
        for f, rng in zip(fleets, rngs, strict=True):
            f.begin_tick(k)
            f.activate(k, a, rng)
            serve(f, workload, k, a, p, g, rng)
            f.control(k, a)
        if progress is not None and (k + warm) % 500 == 499:
            progress(500)
    seconds = ticks * TICK_S
    rank = np.argsort(np.argsort(-workload.endpoints.mean_rps))
    groups = {
        "top 10": np.flatnonzero(rank < 10),
        "11-100": np.flatnonzero((rank >= 10) & (rank < 100)),
        "101+": np.flatnonzero(rank >= 100),
    }
    return {
        "seed": seed,
        "pool_nodes": nodes,
        "static_replicas": int(static.sum()),
        "endpoints_by_model": np.bincount(workload.endpoints.model, minlength=7).tolist(),
        "cpu_s": round(time.process_time() - started, 1),
        "variants": {
            f.name: f.counters.summary(seconds) | {"by_group": f.counters.by_group(groups)}
            for f in fleets
        },
    }
