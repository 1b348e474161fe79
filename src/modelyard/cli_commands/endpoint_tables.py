"""How the endpoint commands show an endpoint: its versions with weights and replicas, the
canary's SLO state, the progress line of a deploy or rollout.

Everything here reads the endpoint's JSON view (`GET /v1/endpoints/{id}`) defensively: a field
a newer or older platform lacks shows as `-`, never as a crash, so the CLI and the platform need
not be upgraded together.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.table import Table

from modelyard.cli_commands.output import Column, console, field, safe, when


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def replica_items(view: dict[str, Any]) -> list[dict[str, Any]]:
    """The replicas, from `replicas.items` (or a bare `replicas` list)."""
    replicas = view.get("replicas")
    items = replicas if isinstance(replicas, list) else _dict(replicas).get("items")
    return [i for i in items or [] if isinstance(i, dict)]


def replica_counts(view: dict[str, Any]) -> str:
    r = _dict(view.get("replicas"))
    return f"{r.get('ready', 0)}/{r.get('desired', 0)}"


def _versions_block(view: dict[str, Any]) -> dict[str, Any]:
    """The view's `versions` object (`weights`, `canary`, `items`, `last_rollback`), if any."""
    raw = view.get("versions")
    return raw if isinstance(raw, dict) and "items" in raw else {}


def weights_of(view: dict[str, Any]) -> dict[str, Any]:
    """Percent of requests by version id: the view's `traffic` (set while several versions
    serve), else the versions' own weights; one version alone has them all."""
    for value in (view.get("traffic"), _versions_block(view).get("weights")):
        if isinstance(value, dict) and value:
            return value
    weighted = {vid: v.get("weight") for vid, v in versions_of(view).items()}
    return {vid: w for vid, w in weighted.items() if w is not None}


def versions_of(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The endpoint's versions by id (`versions.items`, or a bare list); without any, the one
    version the endpoint serves, with all of the traffic."""
    raw: Any = view.get("versions")
    if isinstance(raw, dict):
        raw = raw.get("items")
    found: dict[str, dict[str, Any]] = {}
    for v in raw if isinstance(raw, list) else []:
        if isinstance(v, dict):
            vid = v.get("version_id") or v.get("id")
            if vid is not None:
                found[str(vid)] = v
    if not found and view.get("version_id"):
        found[str(view["version_id"])] = {
            "version_id": view["version_id"],
            "model_artifact": view.get("model_artifact"),
            "role": "stable",
            "weight": 100,
        }
    return found


def _artifact(v: dict[str, Any]) -> Any:
    return v.get("model_artifact") or v.get("artifact") or v.get("ref")


def traffic_summary(view: dict[str, Any]) -> str:
    """`demo:1 90% · demo:2 10%`, the largest share first (artifact refs where known, else
    version ids); a previous version kept warm for rollback at 0 % says so."""
    versions = versions_of(view)
    parts = []
    weights = weights_of(view)
    for vid in sorted(weights, key=lambda v: -_number(weights[v])):
        version = versions.get(vid, {})
        warm = " warm" if version.get("role") == "previous" and not weights[vid] else ""
        parts.append(f"{_artifact(version) or vid} {weights[vid]}%{warm}")
    return " · ".join(parts) or "-"


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def canary_of(view: dict[str, Any]) -> dict[str, Any]:
    """The running canary: its status and weight (`versions.canary`) with its SLO thresholds
    and last check (its entry in `versions.items`); {} when none runs."""
    canary = _versions_block(view).get("canary") or view.get("canary")
    if not isinstance(canary, dict):
        return {}
    track = versions_of(view).get(str(canary.get("version_id")), {})
    return {**canary, **{k: track[k] for k in ("slo", "last_check") if k in track}}


def last_rollback(view: dict[str, Any]) -> dict[str, Any]:
    value = view.get("last_rollback") or _versions_block(view).get("last_rollback")
    return value if isinstance(value, dict) else {}


def _clip(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def canary_summary(view: dict[str, Any]) -> str:
    """`demo:2 10% serving → 25%`, or, with no canary, the last rollback and why."""
    canary = canary_of(view)
    if canary:
        text = f"{_artifact(canary) or canary.get('version_id')} {canary.get('weight')}% "
        text += str(canary.get("status") or "-")
        if canary.get("next_step") is not None:
            text += f" → {canary['next_step']}%"
        return text
    rollback = last_rollback(view)
    if rollback.get("reason"):
        return _clip(f"rolled back ({rollback.get('by', '?')}): {rollback['reason']}")
    return "-"


def slo_line(slo: dict[str, Any]) -> str:
    """`error rate ≤ stable + 5% · p95 ≤ 1.5× stable · ≥ 50 requests in 60 s · steps 5→100`."""
    parts = []
    if slo.get("max_error_rate_delta") is not None:
        parts.append(f"error rate ≤ stable + {float(slo['max_error_rate_delta']) * 100:g}%")
    if slo.get("max_p95_ratio") is not None:
        parts.append(f"p95 ≤ {slo['max_p95_ratio']:g}× stable")
    if slo.get("min_samples") is not None:
        parts.append(f"≥ {slo['min_samples']} requests in {slo.get('window_s', '?'):g} s")
    if slo.get("steps"):
        parts.append("steps " + "→".join(str(x) for x in slo["steps"]))
    return " · ".join(parts) or "-"


def check_line(check: dict[str, Any]) -> str:
    """The gate's last look: each version's error rate and p95 over its requests."""
    if not check:
        return "not judged yet"

    def side(name: str) -> str:
        rate = check.get(f"{name}_error_rate")
        p95 = check.get(f"{name}_p95_ms")
        shown_rate = "-" if rate is None else f"{float(rate) * 100:.1f}%"
        shown_p95 = "-" if p95 is None else f"{float(p95):.0f} ms"
        return (
            f"{name} {shown_rate} errors, p95 {shown_p95} ({check.get(f'{name}_requests', 0)} req)"
        )

    verdict = "judged" if check.get("judged") else "too few requests to judge"
    return f"{side('canary')} · {side('stable')} · {verdict}"


ENDPOINT_COLUMNS: list[Column] = [
    ("ID", field("endpoint_id")),
    ("MODEL", field("model_name")),
    ("KIND", lambda r: str(r.get("model_kind") or r.get("kind") or "-")),
    ("STATUS", field("status")),
    ("REPLICAS", replica_counts),
    ("TRAFFIC", traffic_summary),
    ("CANARY", canary_summary),
    ("PUBLIC", field("public")),
]


def version_rows(view: dict[str, Any]) -> list[list[str]]:
    """One row per version: id, artifact, role, weight, replicas ready/live, status."""
    weights = weights_of(view)
    ready: Counter[str] = Counter()
    live: Counter[str] = Counter()
    for item in replica_items(view):
        vid = str(item.get("version_id"))
        if item.get("state") in ("starting", "ready", "unhealthy"):
            live[vid] += 1
        if item.get("state") == "ready":
            ready[vid] += 1
    rows = []
    for vid, v in versions_of(view).items():
        weight = weights.get(vid, v.get("weight"))
        own = v.get("replicas")
        counts = (
            f"{own.get('ready', 0)}/{own.get('live', 0)}"
            if isinstance(own, dict)
            else f"{ready[vid]}/{live[vid]}"
        )
        rows.append(
            [
                vid,
                str(_artifact(v) or "-"),
                str(v.get("role") or "-"),
                "-" if weight is None else f"{weight}%",
                counts,
                str(v.get("state") or v.get("status") or "-"),
            ]
        )
    return rows


def _progress(item: dict[str, Any]) -> str:
    """A starting replica's load progress (`loading 40%`), when the platform reports it."""
    p = item.get("load_progress")
    if not isinstance(p, dict) or not p.get("phase"):
        return ""
    fraction = p.get("fraction")
    if isinstance(fraction, (int, float)) and p.get("phase") != "ready":
        return f"{p['phase']} {fraction * 100:.0f}%"
    return str(p["phase"])


def show_endpoint(view: dict[str, Any]) -> None:
    """The endpoint as people read it: a summary, its versions, the canary, its replicas."""
    view = safe(view)  # tenant-chosen text (names, messages) never reaches the terminal raw
    summary = Table(show_header=False, title=f"Endpoint {view.get('endpoint_id')}",
                    title_justify="left")  # fmt: skip
    summary.add_column(style="bold")
    summary.add_column(overflow="fold")
    for label, value in (
        ("model", view.get("model_name")),
        ("status", view.get("status")),
        ("message", view.get("status_message")),
        ("replicas", replica_counts(view)),
        ("traffic", traffic_summary(view)),
        ("created", when(view.get("created_at"))),
        ("url", view.get("endpoint_url")),
    ):
        summary.add_row(label, "-" if value in (None, "") else str(value))
    console.print(summary)

    versions = Table(title="Versions", title_justify="left")
    for header in ("VERSION", "ARTIFACT", "ROLE", "WEIGHT", "READY/LIVE", "STATUS"):
        versions.add_column(header, no_wrap=header == "VERSION", overflow="fold")
    for row in version_rows(view):
        versions.add_row(*row)
    console.print(versions)

    canary, rollback = canary_of(view), last_rollback(view)
    if canary or rollback:
        gate = Table(show_header=False, title="Canary", title_justify="left")
        gate.add_column(style="bold")
        gate.add_column(overflow="fold")
        if canary:
            gate.add_row("canary", canary_summary(view))
            gate.add_row("SLO", slo_line(canary.get("slo") or {}))
            gate.add_row("last check", check_line(canary.get("last_check") or {}))
        if rollback:
            moved = f"{rollback.get('from_model_artifact')} → {rollback.get('to_model_artifact')}"
            gate.add_row("last rollback", f"{when(rollback.get('at'))} by {rollback.get('by')}: "
                         f"{moved}: {rollback.get('reason')}")  # fmt: skip
            numbers = rollback.get("numbers")
            if isinstance(numbers, dict) and numbers:
                gate.add_row("numbers", check_line({"judged": True, **numbers}))
        console.print(gate)

    items = replica_items(view)
    if items:
        replicas = Table(title="Replicas", title_justify="left")
        for header in ("REPLICA", "VERSION", "STATE", "PROGRESS", "OUTSTANDING", "ERROR"):
            replicas.add_column(header, no_wrap=header == "REPLICA", overflow="fold")
        for i in items:
            replicas.add_row(
                str(i.get("id", "-")),
                str(i.get("version_id") or "-"),
                str(i.get("state", "-")),
                _progress(i) or "-",
                str(i.get("outstanding", "-")),
                str(i.get("error") or "-"),
            )
        console.print(replicas)


def progress_line(view: dict[str, Any], elapsed: float) -> str:
    """`tiny: provisioning · replicas 0/1 (starting: loading 40%) · 12s · <status message>`."""
    view = safe(view)  # rich markup, its escapes and control characters made literal
    states = ", ".join(
        str(i.get("state")) + (f": {p}" if (p := _progress(i)) else "") for i in replica_items(view)
    )
    parts = [f"{view.get('model_name')}: {view.get('status')}",
             f"replicas {replica_counts(view)}" + (f" ({states})" if states else ""),
             f"{elapsed:.0f}s"]  # fmt: skip
    if len(versions_of(view)) > 1:
        parts.append(f"traffic {traffic_summary(view)}")
    if view.get("status_message"):
        parts.append(str(view["status_message"]))
    return " · ".join(parts)
