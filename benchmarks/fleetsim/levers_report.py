"""The levers' tables: shared-base adapters (issue 24) and batch backfill, elastic nodes and spot
(issue 25), mean ± 95 % CI over seeds, from `levers.run_levers` results.

Cost is in on-demand node-hours (a price per node-hour times it gives money): a spot node-hour
costs `1 - SPOT_DISCOUNT` of an on-demand one (stated: 60 % off; AWS and Google Cloud quote
discounts of up to 90 % and 60-91 %), and `SPOT_REDO` more spot work is paid for what reclaimed
nodes lose (stated: 5 %; a reclaimed node's batch items are leased again elsewhere). A static
pool pays for its peak nodes all along; elastic nodes only while they hold a device.
"""

from __future__ import annotations

from math import nan
from typing import Any

from fleetsim.report import _cell, aggregate

SPOT_DISCOUNT = 0.6
SPOT_REDO = 0.05

ADAPTER_ROWS = (
    ("token-slot utilization %", "token_slot_utilization_pct", 1),
    ("device-hours", "device_hours", 0),
    ("node-hours (8 devices each)", "node_hours", 0),
    ("peak devices", "peak_devices", 0),
    ("endpoints the autoscaler runs (own + shared bases)", "units", 0),
    ("TTFT warm p50 s", "ttft_warm_p50_s", 3),
    ("TTFT warm p99 s", "ttft_warm_p99_s", 2),
    ("TTFT cold p50 s (replica start or adapter load)", "ttft_cold_p50_s", 2),
    ("TTFT cold p99 s", "ttft_cold_p99_s", 1),
    ("cold requests %: replica start", "cold_request_pct", 3),
    ("cold requests %: adapter load", "adapter_cold_pct", 3),
    ("cold requests %: either", "cold_or_adapter_pct", 3),
    ("cold sessions %", "cold_session_pct", 1),
    ("rejected (429) %", "rejected_pct", 3),
    ("replica starts", "replica_starts", 0),
    ("device share: shared bases %", "by_group.shared bases.device_share_pct", 1),
    ("  their utilization %", "by_group.shared bases.token_slot_utilization_pct", 1),
    ("  own endpoints' utilization %", "by_group.own endpoints.token_slot_utilization_pct", 1),
)


def adapter_table(agg: dict[str, dict[str, Any]], names: list[str]) -> str:
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, key, digits in ADAPTER_ROWS:
        cells = [_cell(agg[n].get(key), digits) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _combo(v: dict[str, Any], scen: str | None, elastic: bool, spot: bool) -> dict[str, float]:
    """One seed's figures of a fleet (and its batch scenario) priced one way."""
    mode = "elastic" if elastic else "static"
    h = v["device_hours"] / max(v["mean_devices"], 1e-9)  # run length in hours
    if scen is None:
        rt = v["node_hours"] if elastic else v["peak_nodes"] * h
        return {
            "token_slot_utilization_pct": v["token_slot_utilization_pct"],
            "device_hours": v["device_hours"],
            "node_hours": rt,
            "cost": rt,
            "ttft_warm_p99_s": v["ttft_warm_p99_s"],
        }
    s = v["scenarios"][scen]
    rt, batch = s[f"rt_node_hours_{mode}"], s[f"batch_node_hours_{mode}"]
    price = (1 - SPOT_DISCOUNT) * (1 + SPOT_REDO) if spot else 1.0
    return {
        "token_slot_utilization_pct": s["token_slot_utilization_pct"],
        "device_hours": s["device_hours"],
        "node_hours": rt + batch,
        "cost": rt + price * batch,
        "ttft_warm_p99_s": v["ttft_warm_p99_s"],
        "batch_share_of_tokens_pct": s["batch_share_of_tokens_pct"],
        "backfilled_pct": 100 * s["batch_tokens_backfilled"] / max(s["batch_tokens_served"], 1e-9),
        "batch_done_pct": 100 * s["batch_tokens_served"] / max(s["batch_tokens_submitted"], 1e-9),
        "batch_windows_met_pct": s["batch_windows_met_pct"] if s["batch_jobs_judged"] else nan,
    }


Row = tuple[str, str, str | None, bool, bool]


def combos(batch_shares: list[float], names: set[str]) -> list[Row]:
    """(label, fleet, scenario, elastic, spot) rows of the batch table, where the run has them."""
    rows = []
    for b in batch_shares:
        pct = f"{100 * b:g} %"
        if b == 0:
            cand = [
                (f"{pct}: autoscaled, static pool", "autoscaled", None, False, False),
                (f"{pct}: elastic nodes", "autoscaled", None, True, False),
                (f"{pct}: elastic + adapters 80 %", "adapters 80 %", None, True, False),
                (f"{pct}: elastic + adapters 100 %", "adapters 100 %", None, True, False),
            ]
        else:
            asap, bf = f"asap {b:g}", f"backfill {b:g}"
            fill = f"backfill {pct}"
            cand = [
                (f"{pct}: none (batch replicas at once, static)", "autoscaled", asap, False, False),
                (f"{pct}: backfill", fill, bf, False, False),
                (f"{pct}: elastic nodes", "autoscaled", asap, True, False),
                (f"{pct}: spot batch replicas", "autoscaled", asap, False, True),
                (f"{pct}: all three", fill, bf, True, True),
                (f"{pct}: all three + adapters 80 %", f"{fill} + adapters 80 %", bf, True, True),
                (f"{pct}: all three + adapters 100 %", f"{fill} + adapters 100 %", bf, True, True),
            ]
        rows += [c for c in cand if c[1] in names]
    return rows


BATCH_COLS = (
    ("token-slot util. %", "token_slot_utilization_pct", 1),
    ("device-hours", "device_hours", 0),
    ("node-hours", "node_hours", 0),
    ("cost (on-demand node-h)", "cost", 0),
    ("warm TTFT p99 s", "ttft_warm_p99_s", 2),
    ("vs autoscaled", "ttft_ratio", 2),
    ("batch windows met %", "batch_windows_met_pct", 1),
    ("batch served in the run %", "batch_done_pct", 1),
    ("batch backfilled %", "backfilled_pct", 0),
    ("batch % of tokens", "batch_share_of_tokens_pct", 1),
)


def batch_table(runs: list[dict[str, Any]], batch_shares: list[float]) -> str:
    names = {n for r in runs for n in r["variants"]}
    rows = combos(batch_shares, names)
    head = "| batch share: levers | seeds | " + " | ".join(c[0] for c in BATCH_COLS) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(BATCH_COLS)]
    for label, fleet, scen, elastic, spot in rows:
        per_seed = []
        for run in [r for r in runs if fleet in r["variants"]]:
            fig = _combo(run["variants"][fleet], scen, elastic, spot)
            base = run["variants"].get("autoscaled", {}).get("ttft_warm_p99_s", float("nan"))
            fig["ttft_ratio"] = fig["ttft_warm_p99_s"] / base
            per_seed.append({"variants": {"x": fig}})
        agg = aggregate(per_seed)["x"]
        cells = [_cell(agg.get(key), digits) for _, key, digits in BATCH_COLS]
        lines.append(f"| {label} | {len(per_seed)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def text(runs: list[dict[str, Any]], meta: dict[str, Any], attribution: str) -> str:
    names = list(dict.fromkeys(n for r in runs for n in r["variants"]))
    agg = {  # each fleet over the seeds that ran it
        n: aggregate([{"variants": {n: r["variants"][n]}} for r in runs if n in r["variants"]])[n]
        for n in names
    }
    adapters = [n for n in names if n == "autoscaled" or n.startswith("adapters")]
    shares = sorted({0.0, *meta.get("batch_shares", [])})
    parts = [
        f"{meta['endpoints']} endpoints, {meta['days']:g} simulated days, seeds {meta['seeds']}; "
        f"mean ± 95 % CI over seeds; {meta['real_s']:.0f} s real time",
        f"Traffic: {attribution}.",
        "",
        "Shared-base adapters:",
        "",
        adapter_table(agg, adapters),
        "",
        "Batch, backfill, elastic nodes, spot:",
        "",
        batch_table(runs, shares),
    ]
    return "\n".join(parts)
