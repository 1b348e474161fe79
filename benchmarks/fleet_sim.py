"""Trace-driven fleet simulation: the platform's control plane on a simulated GPU fleet.

    python benchmarks/fleet_sim.py                      # 1,000 endpoints, 2 days, seeds 0 1 2
    python benchmarks/fleet_sim.py --quick              # 100 endpoints, 1 hour, one seed
    python benchmarks/fleet_sim.py --endpoints 300 --days 1 --seeds 0 1 2 \\
        --variants autoscaled static-p99 --cold-start-scale 3 --release-delay-s 0 --json out.json

The platform's own `LoadTracker`, `Autoscaler`, `Placement` and `scale_down_order` run a fleet
of H100 nodes (8 devices each) serving traffic built from the Azure LLM inference traces
(see `benchmarks/fleetsim/`: `trace`, `workload`, `service`, `fleet`, `serving`, `metrics`,
`variants`, `runner`, `report`; each module's docstring states its model and numbers).
Utilization is token-slot utilization: tokens processed / token capacity of the provisioned
devices. Each seed runs every variant in lockstep on the same arrivals (A/B in the same run);
seeds run in parallel (`--workers`, default 2), and `--split N` runs each seed's variants as N
jobs on the same arrivals (the same figures; it keeps both workers busy with 3 seeds). Prints a
markdown table (mean ± 95 % CI over seeds) and optionally writes every figure as JSON.

Traffic: Azure LLM inference traces 2023 (Azure Public Dataset, CC-BY 4.0), Patel et al.,
"Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024. The data is
read from ../shared/data/azure-llm-inference-2023/ beside the checkout, or --trace-dir.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import replace
from multiprocessing import Manager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleetsim.report import text
from fleetsim.runner import RunSpec, run_seed
from fleetsim.trace import load_all
from fleetsim.variants import AB, MAIN, SENSITIVITY, Variant, catalogue
from fleetsim.workload import TICK_S, WorkloadSpec

_queue: Any = None


def _init(queue: Any) -> None:
    global _queue
    _queue = queue


def _job(spec: RunSpec, seed: int, variants: list[Variant], ids: list[int]) -> dict[str, Any]:
    return run_seed(
        spec, seed, variants, progress=lambda n: _queue.put(n) if _queue else None, rng_ids=ids
    )


def _merge(parts: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One seed's result from the results of parts of its variants (`--split`)."""
    out = dict(parts[0])
    out["cpu_s"] = round(sum(p["cpu_s"] for p in parts), 1)
    every = {k: v for p in parts for k, v in p["variants"].items()}
    out["variants"] = {name: every[name] for name in names}
    return out


def _bar(done: int, total: int, started: float) -> None:
    frac = done / max(total, 1)
    elapsed = time.perf_counter() - started
    eta = elapsed / frac - elapsed if frac > 0 else float("nan")
    bar = "#" * int(30 * frac)
    sys.stderr.write(f"\r[{bar:<30}] {100 * frac:5.1f} %  {elapsed:5.0f} s, eta {eta:5.0f} s")
    sys.stderr.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100 endpoints, 1 hour, seed 0")
    ap.add_argument("--endpoints", type=int, default=1000)
    ap.add_argument("--days", type=float, default=2.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument(
        "--variants",
        nargs="+",
        help=f"default: {' '.join([*MAIN, *SENSITIVITY, *AB])} (--quick: the first two)",
    )
    ap.add_argument("--total-rps", type=float, default=WorkloadSpec.total_rps)
    ap.add_argument("--cold-start-scale", type=float, default=1.0, help="x every cold start")
    ap.add_argument("--release-delay-s", type=float, default=600.0)
    ap.add_argument("--device", default="h100", choices=["h100", "a100", "l4"])
    ap.add_argument("--trace-dir", type=Path)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--split",
        type=int,
        default=1,
        help="run each seed's variants as this many jobs (same figures; balances the workers)",
    )
    ap.add_argument("--warmup-s", type=float, default=3600.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.endpoints, args.days, args.seeds, args.warmup_s = 100, 1 / 24, [0], 600.0
        args.variants = args.variants or list(MAIN[:2])
    args.variants = args.variants or [*MAIN, *SENSITIVITY, *AB]
    load_all(args.trace_dir)  # fail early, with the path, if the traces are missing
    spec = RunSpec(
        WorkloadSpec(endpoints=args.endpoints, total_rps=args.total_rps),
        days=args.days,
        warmup_s=args.warmup_s,
        device=args.device,
        trace_dir=args.trace_dir,
    )
    cat = catalogue()
    unknown = [v for v in args.variants if v not in cat]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {sorted(cat)}")
    variants = [
        replace(
            cat[v],
            policy=replace(
                cat[v].policy,
                cold_scale=cat[v].policy.cold_scale * args.cold_start_scale,
                release_delay_s=args.release_delay_s,
            ),
        )
        for v in args.variants
    ]
    started = time.perf_counter()
    parts = max(1, min(args.split, len(variants)))
    total = len(args.seeds) * parts * round((args.days * 86400 + args.warmup_s) / TICK_S)
    done = 0
    ids = list(range(len(variants)))
    groups = [ids[i::parts] for i in range(parts)]
    if args.workers <= 1 or len(args.seeds) * parts == 1:
        runs = []
        for seed in args.seeds:

            def tick(n: int) -> None:
                nonlocal done
                done += n
                _bar(done, total, started)

            runs.append(
                _merge([
                    run_seed(spec, seed, [variants[i] for i in g], progress=tick, rng_ids=g)
                    for g in groups
                ], args.variants)
            )  # fmt: skip
    else:
        queue = Manager().Queue()
        with ProcessPoolExecutor(args.workers, initializer=_init, initargs=(queue,)) as pool:
            futures = {
                (s, k): pool.submit(_job, spec, s, [variants[i] for i in g], g)
                for s in args.seeds
                for k, g in enumerate(groups)
            }
            pending = set(futures.values())
            while pending:
                finished, pending = wait(pending, timeout=2.0, return_when=FIRST_COMPLETED)
                for (s, k), fut in futures.items():
                    if args.json and fut in finished and fut.exception() is None:
                        # Each job as it ends, so a run stopped early keeps what it finished.
                        part = args.json.with_suffix(f".seed{s}.part{k}.json")
                        part.write_text(json.dumps(fut.result(), indent=1, default=float))
                while not queue.empty():
                    done += queue.get()
                _bar(done, total, started)
            runs = [
                _merge([futures[s, k].result() for k in range(parts)], args.variants)
                for s in args.seeds
            ]
    sys.stderr.write("\n")
    meta = {
        "endpoints": args.endpoints,
        "days": args.days,
        "seeds": args.seeds,
        "device": spec.device,
        "total_rps": args.total_rps,
        "cold_start_scale": args.cold_start_scale,
        "release_delay_s": args.release_delay_s,
        "real_s": time.perf_counter() - started,
    }
    print(text(runs, meta))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1, default=float))


if __name__ == "__main__":
    main()
