"""Routing lookup and controller tick at fleet size: 10,000 endpoints in one process's tables.

* lookup: `RoutingTable.resolve` + `RoutingTable.pick` for a random tenant's model (its own
  endpoints, or a public one), timed one call at a time; p50/p99/max in microseconds. The table
  holds `--endpoints` endpoints over `--tenants` tenants (one in `--public-every` public), each
  with `--replicas` ready replicas.
* tick: the control plane's autoscaling decision pass (`Scaler.autoscale`, which feeds each
  endpoint's `LoadTracker` observation to its `Autoscaler` and takes its decision) over every
  endpoint, as the reconcile loop runs it each tick; `--ticks` passes, back to back, the
  controller's clock stepped by `--tick-interval` (2 s, the default health_check_interval_s)
  each pass, so the autoscaler's windows hold as many samples as in production.

Pure CPU, no network: what this measures is the code, not the health checks' I/O.

    python benchmarks/routing_tick.py [--endpoints 10000] [--lookups 20000] [--ticks 30]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# BENCH_SRC: another checkout's src (an A/B against an older commit in the same run).
sys.path.insert(0, os.environ.get("BENCH_SRC") or str(Path(__file__).resolve().parents[1] / "src"))

from modelyard.config import PlatformSettings
from modelyard.control import scaling
from modelyard.control.autoscaler import Autoscaler, ScalingPolicy
from modelyard.control.prewarm import TrafficHistory
from modelyard.control.scaling import LoadTracker, Scaler
from modelyard.control.state import EndpointState, Replica
from modelyard.core.routing import EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.core.status import EndpointStatus, ReplicaState
from modelyard.store.tables import Endpoint


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def build(args: argparse.Namespace) -> tuple[RoutingTable, list[EndpointState]]:
    table = RoutingTable()
    states: list[EndpointState] = []
    for i in range(args.endpoints):
        tenant = f"t{i % args.tenants}"
        public = i % args.public_every == 0
        name = f"model-{i % args.model_names}"
        row = Endpoint(id=f"ep-{i:06d}", tenant_id=tenant, model_name=name, public=public)
        route = EndpointRoute(
            endpoint_id=row.id,
            tenant_id=tenant,
            model_name=row.model_name,
            public=public,
            version_id=None,
            max_tokens_cap=4096,
        )
        table.publish(route)
        state = EndpointState(row=row, route=route, status=EndpointStatus.READY, desired=2)
        for r in range(args.replicas):
            rr = ReplicaRoute(replica_id=f"{row.id}-r{r}", url=f"http://10.0.{r}.1:8000")
            rr.outstanding = 6  # 12 in flight, target 8 a replica: steady at 2 replicas
            table.add_replica(route, rr)
            load = {"running": rr.outstanding, "waiting": 0, "busy_seconds": 0.0}
            state.replicas.append(
                Replica(replica_id=rr.replica_id, route=rr, state=ReplicaState.READY, load=load)
            )
        policy = ScalingPolicy(metric="concurrency", target=8, min_replicas=1, max_replicas=4)
        state.autoscaler = Autoscaler(policy)
        state.load = LoadTracker(policy.metric)
        states.append(state)
    return table, states


def lookups(table: RoutingTable, args: argparse.Namespace) -> list[float]:
    rng = random.Random(1)
    out: list[float] = []
    for _ in range(args.lookups):
        tenant_n = rng.randrange(args.tenants)
        if rng.random() < 0.2:  # a public model, seen from another tenant
            i = rng.randrange(0, args.endpoints, args.public_every)
        else:  # one of the tenant's own
            i = tenant_n + args.tenants * rng.randrange(args.endpoints // args.tenants)
        t0 = time.perf_counter_ns()
        route = table.resolve(f"t{tenant_n}", f"model-{i % args.model_names}")
        replica = table.pick(route) if route is not None else None
        out.append((time.perf_counter_ns() - t0) / 1000)
        assert replica is not None, (tenant_n, i)
    return out


def ticks(states: list[EndpointState], args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Each pass's wall time and this process's CPU time (ms): on a shared, loaded machine
    the CPU time is the closer estimate of the pass on a quiet one."""
    scaler = Scaler(PlatformSettings(), TrafficHistory())
    wall: list[float] = []
    cpu: list[float] = []
    # The controller's clock steps one tick interval per pass, so the autoscaler's windows hold
    # as many samples as in production however long a pass takes here.
    clock = [time.monotonic()]
    epoch = time.time() - clock[0]
    scaling.time = SimpleNamespace(monotonic=lambda: clock[0], time=lambda: epoch + clock[0])
    for _ in range(args.ticks):
        clock[0] += args.tick_interval
        for state in states:  # traffic between ticks
            state.route.requests_total += 3
        t0, c0 = time.perf_counter(), time.process_time()
        for state in states:
            scaler.autoscale(state, lambda s: None)
        wall.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--endpoints", type=int, default=10_000)
    ap.add_argument("--tenants", type=int, default=1_000)
    ap.add_argument("--public-every", type=int, default=100)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument(
        "--model-names",
        type=int,
        default=None,
        help="distinct model names (default: one per endpoint); fewer: many tenants each "
        "deploy the same names, as they would the same popular models",
    )
    ap.add_argument("--lookups", type=int, default=20_000)
    ap.add_argument("--ticks", type=int, default=30)
    ap.add_argument("--tick-interval", type=float, default=2.0, help="s, the controller's")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.model_names = args.model_names or args.endpoints

    random.seed(0)
    table, states = build(args)
    c0 = time.process_time()
    lat = lookups(table, args)
    lookup_cpu_us = (time.process_time() - c0) / args.lookups * 1e6
    tick_ms, tick_cpu_ms = ticks(states, args)
    report: dict[str, Any] = {
        "endpoints": args.endpoints,
        "tenants": args.tenants,
        "model_names": args.model_names,
        "lookup_p50_us": round(pct(lat, 50), 1),
        "lookup_p99_us": round(pct(lat, 99), 1),
        "lookup_max_us": round(max(lat), 1),
        "lookup_mean_cpu_us": round(lookup_cpu_us, 1),
        "tick_median_ms": round(statistics.median(tick_ms), 2),
        "tick_p99_ms": round(pct(tick_ms, 99), 2),
        "tick_max_ms": round(max(tick_ms), 2),
        "tick_cpu_median_ms": round(statistics.median(tick_cpu_ms), 2),
        "tick_cpu_min_ms": round(min(tick_cpu_ms), 2),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
