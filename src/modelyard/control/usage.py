"""Usage reports: metered rows grouped by model, key, team, day or model version (a canary
beside the stable one), priced per model, and CSV export.

A row's cost is the one it was billed at (`cost_micro`: micro-dollars at the model's price when
it ran, what budgets count); rows written before prices were kept are priced with the `prices`
setting. `cost_micro_usd` sums exact integers; `cost_usd` is the same in dollars.

A request to a tenant's registry LoRA adapter is its own model in the report (the adapter's
name; its row names the base endpoint and model, and the adapter's `name:version`), billed at the
adapter's own price when it has one, else at its base endpoint's (`gateway/budgets.py`)."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from modelyard.config import ModelPrice
from modelyard.core.csv_cells import csv_row
from modelyard.core.errors import Invalid
from modelyard.store.repository import as_utc
from modelyard.store.tables import UsageRecord

GROUPS = ("model", "key", "team", "day", "version")
CSV_COLUMNS = (
    "request_id", "created_at", "tenant_id", "key_id", "endpoint_id", "model", "version_id",
    "kind", "prompt_tokens", "completion_tokens", "cached_tokens", "latency_ms", "ttft_ms",
    "status_code", "status", "batch", "cost_usd", "adapter",
)  # fmt: skip


def parse_time(value: str | int | None, param: str) -> datetime | None:
    """Unix seconds or ISO 8601; naive times are UTC."""
    if value is None or value == "":
        return None
    try:
        if isinstance(value, int) or str(value).lstrip("-").isdigit():
            return datetime.fromtimestamp(int(value), UTC)
        ts = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except (ValueError, OverflowError) as exc:
        raise Invalid(
            f"{param} must be unix seconds or ISO 8601, got {value!r}", param=param
        ) from exc
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def cost(row: UsageRecord, prices: dict[str, ModelPrice], batch_discount: float = 0.0) -> float:
    if row.cost_micro is not None:
        return row.cost_micro / 1e6
    price = prices.get(row.model)
    if price is None:
        return 0.0
    cached_price = price.input if price.cached_input is None else price.cached_input
    uncached = row.prompt_tokens - row.cached_tokens
    full = (
        uncached * price.input
        + row.cached_tokens * cached_price
        + row.completion_tokens * price.output
    ) / 1e6
    return full * (1.0 - batch_discount) if row.batch else full


def cost_micro(row: UsageRecord, prices: dict[str, ModelPrice], batch_discount: float = 0.0) -> int:
    """The row's cost in micro-dollars: as billed, else (an older row) priced now, rounded up."""
    if row.cost_micro is not None:
        return row.cost_micro
    return math.ceil(round(cost(row, prices, batch_discount) * 1e6, 6))


def _group_key(row: UsageRecord, group_by: str) -> str:
    if group_by == "model":
        return row.adapter.rpartition(":")[0] if row.adapter else row.model
    if group_by == "key":
        return row.key_id
    if group_by == "team":
        return row.team_id or ""  # "": a key of no team
    if group_by == "version":
        return row.version_id or ""  # "": served from a path, no registry version
    return as_utc(row.created_at).strftime("%Y-%m-%d")


def summarize(
    rows: Sequence[UsageRecord],
    group_by: str,
    prices: dict[str, ModelPrice],
    batch_discount: float = 0.0,
) -> list[dict[str, Any]]:
    if group_by not in GROUPS:
        raise Invalid(f"group_by must be one of {', '.join(GROUPS)}", param="group_by")
    groups: dict[str, dict[str, Any]] = {}
    for row in rows:
        key = _group_key(row, group_by)
        g = groups.setdefault(
            key,
            {
                group_by: key,
                "requests": 0,
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "cached_tokens": 0,
                "total_tokens": 0,
                "cost_usd": 0.0,
                "cost_micro_usd": 0,
            },
        )
        g["requests"] += 1
        g["prompt_tokens"] += row.prompt_tokens
        g["completion_tokens"] += row.completion_tokens
        g["cached_tokens"] += row.cached_tokens
        g["total_tokens"] += row.prompt_tokens + row.completion_tokens
        g["cost_micro_usd"] += cost_micro(row, prices, batch_discount)
    for g in groups.values():
        g["cost_usd"] = g["cost_micro_usd"] / 1e6
    return [groups[k] for k in sorted(groups)]


def to_csv(
    rows: Iterable[UsageRecord], prices: dict[str, ModelPrice], batch_discount: float = 0.0
) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for r in rows:
        writer.writerow(
            csv_row([
                r.request_id, as_utc(r.created_at).isoformat(), r.tenant_id, r.key_id,
                r.endpoint_id or "", r.model, r.version_id or "", r.kind, r.prompt_tokens,
                r.completion_tokens, r.cached_tokens, round(r.latency_ms, 3),
                "" if r.ttft_ms is None else round(r.ttft_ms, 3), r.status_code, r.status,
                int(r.batch), round(cost(r, prices, batch_discount), 8), r.adapter or "",
            ])
        )  # fmt: skip
    return out.getvalue()
