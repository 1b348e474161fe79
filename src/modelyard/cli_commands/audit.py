"""`modelyard audit list`: who changed what and when (the platform's `GET /v1/audit`).

A table of the newest events with what each change did (the fields whose value moved, as
`tier: standard → priority`), `--json` for scripts, or `--csv` for the whole export as the
platform streams it (`GET /v1/audit.csv`).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from modelyard.cli_commands import common
from modelyard.cli_commands.output import Column, api_errors, field, show, when

audit_app = typer.Typer(no_args_is_help=True, help="The audit log: who changed what, and when.")

_MAX_SHOWN = 3  # changed fields in the table's CHANGE cell; --json has them all


def _short(value: Any) -> str:
    text = "-" if value is None else str(value)
    return text if len(text) <= 40 else text[:37] + "…"


def change(event: dict[str, Any]) -> str:
    """What the change did, in a few words: `created`, `deleted` or the fields that moved."""
    before, after = event.get("before"), event.get("after")
    if not isinstance(before, dict) and isinstance(after, dict):
        return "created" if event.get("action", "").endswith(("create", "deploy", "push")) else "-"
    if isinstance(before, dict) and not isinstance(after, dict):
        return "deleted"
    if not isinstance(before, dict) or not isinstance(after, dict):
        return "-"
    moved = [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
    parts = [f"{k}: {_short(before.get(k))} → {_short(after.get(k))}" for k in moved[:_MAX_SHOWN]]
    if len(moved) > _MAX_SHOWN:
        parts.append(f"+{len(moved) - _MAX_SHOWN} more")
    return "; ".join(parts) or "no change"


AUDIT_COLUMNS: list[Column] = [
    ("ID", field("id")),
    ("AT", lambda e: when(e.get("at"))),
    ("TENANT", field("tenant_id")),
    ("ACTOR", field("actor_key_id")),
    ("ACTION", field("action")),
    ("TARGET", field("target_id")),
    ("CHANGE", change),
]


@audit_app.command("list")
def audit_list(
    since: Annotated[str | None, typer.Option(help="Unix seconds or ISO 8601.")] = None,
    until: Annotated[str | None, typer.Option(help="Unix seconds or ISO 8601.")] = None,
    action: Annotated[str | None, typer.Option(help="e.g. endpoint.rollback")] = None,
    target_type: Annotated[str | None, typer.Option(help="endpoint, api_key, tenant…")] = None,
    target_id: Annotated[str | None, typer.Option(help="One endpoint, key or tenant.")] = None,
    tenant_id: Annotated[str | None, typer.Option(help="Platform admin: one tenant.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Events to show.")] = 50,
    after: Annotated[int | None, typer.Option(help="Older than this event id.")] = None,
    as_csv: Annotated[bool, typer.Option("--csv", help="The CSV export (all matching).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """The newest changes first: endpoints, keys, tenants, registry versions."""
    params = {
        "since": since,
        "until": until,
        "action": action,
        "target_type": target_type,
        "target_id": target_id,
        "tenant_id": tenant_id,
        "after": after,
    }
    with api_errors(), common.client() as c:
        if as_csv:
            sys.stdout.write(c.text("/v1/audit.csv", **params))
            return
        page = c.get("/v1/audit", limit=limit, **params)
    show(page["data"], AUDIT_COLUMNS, "Audit log", as_json)
    if page.get("has_more") and not as_json:
        typer.echo(f"(more: --after {page['last_id']})", err=True)
