"""Seeds -> means with 95 % confidence intervals, and the tables BENCHMARKS.md quotes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fleetsim.trace import ATTRIBUTION

# Student's t, two-sided 95 %, by degrees of freedom.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval (0 for one seed)."""
    v = np.array([x for x in values if not (isinstance(x, float) and math.isnan(x))], float)
    if len(v) == 0:
        return float("nan"), float("nan")
    if len(v) == 1:
        return float(v[0]), 0.0
    t = _T95.get(len(v) - 1, 1.96)
    return float(v.mean()), float(t * v.std(ddof=1) / math.sqrt(len(v)))


def aggregate(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant and figure: [mean, ci] over the seeds (nested dicts flattened with '.')."""
    out: dict[str, dict[str, Any]] = {}
    for name in runs[0]["variants"]:
        flat: dict[str, list[float]] = {}
        for run in runs:
            for key, value in _flatten(run["variants"][name]).items():
                flat.setdefault(key, []).append(value)
        out[name] = {k: mean_ci(v) for k, v in flat.items()}
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flatten(v, f"{prefix}{k}.")
        elif isinstance(v, int | float):
            out[f"{prefix}{k}"] = float(v)
    return out


ROWS = (
    ("token-slot utilization %", "token_slot_utilization_pct", 1),
    ("engine-busy % (old figure)", "engine_busy_pct", 1),
    ("device-hours", "device_hours", 0),
    ("node-hours (8 devices each)", "node_hours", 0),
    ("peak devices", "peak_devices", 0),
    ("TTFT warm p50 s", "ttft_warm_p50_s", 3),
    ("TTFT warm p99 s", "ttft_warm_p99_s", 2),
    ("TTFT warm p99.9 s", "ttft_warm_p99.9_s", 1),
    ("TTFT cold p50 s", "ttft_cold_p50_s", 1),
    ("TTFT cold p99 s", "ttft_cold_p99_s", 1),
    ("queue wait p99 s", "queue_wait_p99_s", 2),
    ("cold requests %", "cold_request_pct", 3),
    ("cold sessions %", "cold_session_pct", 1),
    ("rejected (429) %", "rejected_pct", 3),
    ("replica starts", "replica_starts", 0),
    ("device share: top 10 endpoints %", "by_group.top 10.device_share_pct", 1),
    ("  their utilization %", "by_group.top 10.token_slot_utilization_pct", 1),
    ("device share: 11-100 %", "by_group.11-100.device_share_pct", 1),
    ("  their utilization %", "by_group.11-100.token_slot_utilization_pct", 1),
    ("device share: 101+ %", "by_group.101+.device_share_pct", 1),
    ("  their utilization %", "by_group.101+.token_slot_utilization_pct", 1),
)


def _cell(v: tuple[float, float] | None, digits: int) -> str:
    if v is None or math.isnan(v[0]):
        return "n/a"
    mean, ci = v
    text = f"{mean:,.{digits}f}"
    return text + (f" ± {ci:,.{digits}f}" if ci > 0 else "")


def table(agg: dict[str, dict[str, Any]], names: list[str]) -> str:
    """A markdown table: one row per figure, one column per variant (mean ± 95 % CI)."""
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, key, digits in ROWS:
        cells = [_cell(agg[n].get(key), digits) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def delay_table(agg: dict[str, dict[str, Any]], name: str) -> str:
    keys = sorted(
        {k.split(".")[1] for k in agg[name] if k.startswith("by_release_delay.")}, key=float
    )
    lines = [
        "| release delay | token-slot utilization % | device-hours | node-hours |",
        "|---|---:|---:|---:|",
    ]
    for d in keys:
        row = [
            _cell(agg[name].get(f"by_release_delay.{d}.{k}"), digits)
            for k, digits in (
                ("token_slot_utilization_pct", 1),
                ("device_hours", 0),
                ("node_hours", 0),
            )
        ]
        lines.append(f"| {d} s | " + " | ".join(row) + " |")
    return "\n".join(lines)


def text(runs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    agg = aggregate(runs)
    names = list(runs[0]["variants"])
    parts = [
        f"{meta['endpoints']} endpoints, {meta['days']:g} simulated days, seeds {meta['seeds']}, "
        f"{meta['device']}; mean ± 95 % CI over seeds; {meta['real_s']:.0f} s real time",
        f"Traffic: {ATTRIBUTION}.",
        "",
        table(agg, names),
        "",
        f"Release delay ({names[0]}):",
        "",
        delay_table(agg, names[0]),
    ]
    return "\n".join(parts)
