"""The fleet simulator's levers: shared-base adapters (issue 24), batch backfill, elastic nodes
and spot (issue 25), on the same arrivals as `fleet_sim.py`'s autoscaled fleet.

    python benchmarks/fleet_levers.py                    # 1,000 endpoints, 2 days, seeds 0 1 2
    python benchmarks/fleet_levers.py --groups adapters  # only the adapter sweep
    python benchmarks/fleet_levers.py --quick            # 100 endpoints, 1 hour, seed 0

Fleets (`fleetsim/levers.py`): `autoscaled` (the platform's defaults; with batch shares 25 and
50 % accounted beside it on batch replicas, as today), `adapters 50/80/100 %` (that share of the
endpoints are adapters on shared base replicas), `backfill 25/50 %` (batch in the idle slots of
warm replicas, preempted by real-time) and those with adapters. Each seed's fleets are split
into the two groups, `adapters` and `backfill`, run as separate jobs on the same arrivals.
Prints both tables (mean ± 95 % CI over seeds) and optionally writes every figure as JSON.

Traffic: Azure LLM inference traces 2023 (Azure Public Dataset, CC-BY 4.0), Patel et al.,
"Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024, read from
../shared/data/azure-llm-inference-2023/ beside the checkout, or --trace-dir.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleetsim.levers import Lever, run_levers
from fleetsim.levers_report import text
from fleetsim.runner import RunSpec
from fleetsim.trace import ATTRIBUTION, load_all
from fleetsim.workload import WorkloadSpec

BATCH = (0.25, 0.5)
GROUPS = {
    "adapters": [
        Lever("autoscaled", asap=BATCH),
        Lever("adapters 50 %", adapters=0.5),
        Lever("adapters 80 %", adapters=0.8),
        Lever("adapters 100 %", adapters=1.0),
    ],
    "backfill": [
        Lever("backfill 25 %", backfill=0.25),
        Lever("backfill 50 %", backfill=0.5),
        Lever("backfill 25 % + adapters 80 %", adapters=0.8, backfill=0.25),
        Lever("backfill 50 % + adapters 80 %", adapters=0.8, backfill=0.5),
        Lever("backfill 50 % + adapters 100 %", adapters=1.0, backfill=0.5),
    ],
}


def _job(spec: RunSpec, seed: int, levers: list[Lever]) -> dict[str, Any]:
    out = run_levers(spec, seed, levers)
    out["meta"] = {"endpoints": spec.workload.endpoints, "days": spec.days}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100 endpoints, 1 hour, seed 0")
    ap.add_argument("--endpoints", type=int, default=1000)
    ap.add_argument("--days", type=float, default=2.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--levers", nargs="+", help="only these fleets (names as in the tables)")
    ap.add_argument(
        "--report", type=Path, nargs="+", help="print the tables of saved job JSONs and exit"
    )
    ap.add_argument("--trace-dir", type=Path)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--warmup-s", type=float, default=3600.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.report:
        report(args.report)
        return
    if args.quick:
        args.endpoints, args.days, args.seeds, args.warmup_s = 100, 1 / 24, [0], 600.0
    load_all(args.trace_dir)  # fail early, with the path, if the traces are missing
    spec = RunSpec(
        WorkloadSpec(endpoints=args.endpoints),
        days=args.days,
        warmup_s=args.warmup_s,
        trace_dir=args.trace_dir,
    )
    started = time.perf_counter()
    groups = {g: GROUPS[g] for g in args.groups}
    if args.levers:
        every = {lever.name: lever for g in GROUPS.values() for lever in g}
        groups = {"+".join(args.levers): [every[n] for n in args.levers]}
    jobs = [(s, g) for g in groups for s in args.seeds]  # the adapter sweep first
    with ProcessPoolExecutor(max(1, min(args.workers, len(jobs)))) as pool:
        futures = {(s, g): pool.submit(_job, spec, s, groups[g]) for s, g in jobs}
        results = {}
        for (s, g), fut in futures.items():  # in submission order
            results[s, g] = fut.result()
            if args.json:  # each job as it ends, so a stopped run keeps what it finished
                part = args.json.with_suffix(f".seed{s}.{g}.json")
                part.write_text(json.dumps(results[s, g], indent=1, default=float))
            sys.stderr.write(f"seed {s} {g}: {results[s, g]['cpu_s']} CPU-s\n")
    runs = []
    for s in args.seeds:
        run = {"seed": s, "variants": {}, "cpu_s": 0.0}
        for g in groups:
            run["variants"] |= results[s, g]["variants"]
            run["cpu_s"] += results[s, g]["cpu_s"]
        runs.append(run)
    meta = {
        "endpoints": args.endpoints,
        "days": args.days,
        "seeds": args.seeds,
        "groups": args.groups,
        "batch_shares": list(BATCH),
        "real_s": time.perf_counter() - started,
    }
    print(text(runs, meta, ATTRIBUTION))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1, default=float))


def report(paths: list[Path]) -> None:
    """Tables from job JSONs (`--json` parts), merged per seed; a fleet a seed lacks is left
    out of that seed's figures (the tables say how many seeds each row has)."""
    by_seed: dict[int, dict[str, Any]] = {}
    meta: dict[str, Any] = {"real_s": 0.0, "batch_shares": list(BATCH), "days": 0, "endpoints": 0}
    for path in paths:
        part = json.loads(path.read_text())
        run = by_seed.setdefault(part["seed"], {"seed": part["seed"], "variants": {}, "cpu_s": 0})
        run["variants"] |= part["variants"]
        run["cpu_s"] += part["cpu_s"]
        meta |= part.get("meta", {})
    meta["seeds"] = sorted(by_seed)
    print(text([by_seed[s] for s in sorted(by_seed)], meta, ATTRIBUTION))


if __name__ == "__main__":
    main()
