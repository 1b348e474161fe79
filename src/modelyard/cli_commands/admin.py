"""`modelyard login|whoami`, `tenants …`, `keys …` and `usage …`: the administrative API."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from modelyard.cli_commands import common
from modelyard.cli_commands.client import PlatformClient
from modelyard.cli_commands.output import (
    api_errors,
    console,
    details,
    field,
    print_json,
    show,
    when,
)
from modelyard.cli_commands.profiles import Target, config_path, platform_url, save_profile

tenants_app = typer.Typer(no_args_is_help=True, help="Tenants (platform admin).")
keys_app = typer.Typer(no_args_is_help=True, help="API keys.")
usage_app = typer.Typer(
    help="Usage: requests, tokens and cost (`usage export` for CSV).", invoke_without_command=True
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def login(
    url: Annotated[
        str, typer.Option(help="Platform URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine).")
    ],
    api_key: Annotated[str, typer.Option(help="API key (sk-…).", prompt=True, hide_input=True)],
    profile: Annotated[str, typer.Option(help="Profile name to write.")] = "default",
    verify: Annotated[bool, typer.Option(help="Check the key against the platform first.")] = True,
    make_default: Annotated[
        bool, typer.Option("--default/--no-default", help="Make it the default profile.")
    ] = True,
) -> None:
    """Save URL and key as a profile in config.toml (mode 0600)."""
    url = platform_url(url)
    with api_errors():
        if verify:
            with PlatformClient(Target(url, api_key, "--url", "--api-key")) as c:
                c.get("/v1/models")
        path = save_profile(profile, url, api_key, make_default)
    console.print(f"saved profile [bold]{profile}[/bold] in {path}")


def whoami(as_json: JsonFlag = False) -> None:
    """Which URL and key the next command would use, and where each came from."""
    with api_errors():
        t = common.target()
    key = f"{t.api_key[:7]}…" if t.api_key else None
    info = {"url": t.url, "url_from": t.url_from, "api_key": key, "api_key_from": t.key_from,
            "config": str(config_path())}  # fmt: skip
    details(info, as_json)


# ----- tenants --------------------------------------------------------------------------------

TENANT_COLUMNS = [
    ("ID", field("id")),
    ("NAME", field("name")),
    ("TIER", field("tier")),
    ("QUOTA", field("monthly_token_quota")),
    ("SYSTEM", field("system")),
    ("CREATED", lambda r: when(r.get("created_at"))),
]

Ceiling = Annotated[int | None, typer.Option(min=0)]


def _tenant_body(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


@tenants_app.command("list")
def tenants_list(as_json: JsonFlag = False) -> None:
    """Every tenant."""
    with api_errors(), common.client() as c:
        show(c.get("/v1/tenants")["data"], TENANT_COLUMNS, "Tenants", as_json)


@tenants_app.command("create")
def tenants_create(
    name: str,
    quota: Annotated[int | None, typer.Option(help="Monthly token quota.")] = None,
    tier: Annotated[str | None, typer.Option(help="free, standard or priority.")] = None,
    max_rpm: Ceiling = None,
    max_tpm: Ceiling = None,
    max_endpoints: Ceiling = None,
    max_replicas: Ceiling = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a tenant."""
    body = _tenant_body(
        name=name, monthly_token_quota=quota, tier=tier, max_rpm=max_rpm, max_tpm=max_tpm,
        max_endpoints=max_endpoints, max_replicas=max_replicas,
    )  # fmt: skip
    with api_errors(), common.client() as c:
        details(c.post("/v1/tenants", body), as_json)


@tenants_app.command("show")
def tenants_show(tenant_id: str, as_json: JsonFlag = False) -> None:
    """One tenant."""
    with api_errors(), common.client() as c:
        details(c.get(f"/v1/tenants/{tenant_id}"), as_json)


@tenants_app.command("update")
def tenants_update(
    tenant_id: str,
    quota: Annotated[int | None, typer.Option(help="Monthly token quota.")] = None,
    tier: Annotated[str | None, typer.Option(help="free, standard or priority.")] = None,
    max_rpm: Ceiling = None,
    max_tpm: Ceiling = None,
    max_endpoints: Ceiling = None,
    max_replicas: Ceiling = None,
    as_json: JsonFlag = False,
) -> None:
    """Change a tenant's quota, tier or ceilings (only the options given)."""
    body = _tenant_body(monthly_token_quota=quota, tier=tier, max_rpm=max_rpm, max_tpm=max_tpm,
                        max_endpoints=max_endpoints, max_replicas=max_replicas)  # fmt: skip
    with api_errors(), common.client() as c:
        details(c.patch(f"/v1/tenants/{tenant_id}", body), as_json)


# ----- keys -----------------------------------------------------------------------------------

KEY_COLUMNS = [
    ("ID", field("id")),
    ("NAME", field("name")),
    ("PREFIX", field("prefix")),
    ("TENANT", field("tenant_id")),
    ("SCOPES", lambda r: ",".join(r.get("scopes") or [])),
    ("RPM", field("rpm_limit")),
    ("TPM", field("tpm_limit")),
    (
        "MODELS",
        lambda r: "all" if r.get("allowed_models") is None else ",".join(r["allowed_models"]),
    ),
    ("EXPIRES", lambda r: when(r.get("expires_at"))),
    ("LAST USED", lambda r: when(r.get("last_used_at"))),
    ("CREATED", lambda r: when(r.get("created_at"))),
    ("REVOKED", lambda r: when(r.get("revoked_at"))),
]
Expires = Annotated[
    str | None,
    typer.Option(help="When the key stops working: ISO 8601 (UTC unless an offset is given) "
                 "or unix seconds."),
]  # fmt: skip
Models = Annotated[
    list[str] | None,
    typer.Option("--model", help="A model the key may call, `*` a wildcard (repeatable; "
                 "default: all)."),
]  # fmt: skip
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


def _seconds(text: str) -> int:
    """`90`, `90s`, `30m`, `24h`, `7d` as seconds."""
    text = text.strip().lower()
    unit = _UNITS.get(text[-1:], 0)
    digits = text[:-1] if unit else text
    if not (digits.isascii() and digits.isdigit()):  # not "²", which isdigit() allows
        raise typer.BadParameter(f"{text!r} is not a duration like 90, 30m, 24h or 7d")
    return int(digits) * (unit or 1)


@keys_app.command("list")
def keys_list(as_json: JsonFlag = False) -> None:
    """The keys this key's admin rights cover."""
    with api_errors(), common.client() as c:
        show(c.get("/v1/keys")["data"], KEY_COLUMNS, "API keys", as_json)


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Option(help="A label for the key.")] = "default",
    tenant: Annotated[str | None, typer.Option(help="Tenant id (platform admin).")] = None,
    scope: Annotated[
        list[str] | None, typer.Option(help="inference, admin or metrics (repeatable).")
    ] = None,
    rpm: Annotated[int | None, typer.Option(help="Requests per minute.")] = None,
    tpm: Annotated[int | None, typer.Option(help="Tokens per minute.")] = None,
    expires: Expires = None,
    model: Models = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a key; its secret is shown once."""
    body = _tenant_body(
        name=name, tenant_id=tenant, scopes=scope or None, rpm_limit=rpm, tpm_limit=tpm,
        expires_at=expires, allowed_models=model or None,
    )  # fmt: skip
    with api_errors(), common.client() as c:
        key = c.post("/v1/keys", body)
    if as_json:
        print_json(key)
        return
    console.print(f"created key [bold]{key['id']}[/bold] ({key.get('name')}); its secret, "
                  "shown once:")  # fmt: skip
    typer.echo(key["key"])


@keys_app.command("revoke")
def keys_revoke(key_id: str, as_json: JsonFlag = False) -> None:
    """Revoke a key (it stops working at once)."""
    with api_errors(), common.client() as c:
        result = c.delete(f"/v1/keys/{key_id}")
    if as_json:
        print_json(result)
    else:
        console.print(f"revoked {key_id}")


@keys_app.command("update")
def keys_update(
    key_id: str,
    name: Annotated[str | None, typer.Option()] = None,
    rpm: Annotated[int | None, typer.Option(help="Requests per minute.")] = None,
    tpm: Annotated[int | None, typer.Option(help="Tokens per minute.")] = None,
    expires: Expires = None,
    never_expires: Annotated[bool, typer.Option(help="Remove the key's expiry.")] = False,
    model: Models = None,
    all_models: Annotated[bool, typer.Option(help="Remove the key's model list.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Rename a key or change its limits, expiry (a past time expires it now) or models."""
    body = _tenant_body(name=name, rpm_limit=rpm, tpm_limit=tpm, expires_at=expires,
                        allowed_models=model or None)  # fmt: skip
    if never_expires:
        body["expires_at"] = None
    if all_models:
        body["allowed_models"] = None
    with api_errors(), common.client() as c:
        details(c.patch(f"/v1/keys/{key_id}", body), as_json)


_GRACE_HELP = "How long the old secret keeps working: 90s, 30m, 24h, 7d; 0 stops it at once."


@keys_app.command("rotate")
def keys_rotate(
    key_id: str,
    grace: Annotated[str, typer.Option(help=_GRACE_HELP)] = "24h",
    as_json: JsonFlag = False,
) -> None:
    """A new secret for the key, shown once; the old one works for the grace period."""
    body = {"grace_period_seconds": _seconds(grace)}
    with api_errors(), common.client() as c:
        key = c.post(f"/v1/keys/{key_id}/rotate", body)
    if as_json:
        print_json(key)
        return
    until = when(key.get("previous_key_expires_at"))
    console.print(f"rotated key [bold]{key['id']}[/bold]; the old secret works until {until} "
                  "UTC; the new one, shown once:")  # fmt: skip
    typer.echo(key["key"])


# ----- usage ----------------------------------------------------------------------------------

Start = Annotated[str | None, typer.Option(help="Unix seconds or ISO 8601 (default: month start).")]
End = Annotated[str | None, typer.Option(help="Unix seconds or ISO 8601 (default: now).")]
TenantOpt = Annotated[str | None, typer.Option("--tenant", help="Tenant id (platform admin).")]


@usage_app.callback()
def usage(
    ctx: typer.Context,
    group_by: Annotated[str, typer.Option(help="model, key, team, day or version.")] = "model",
    start: Start = None,
    end: End = None,
    tenant: TenantOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """Requests, tokens and cost (USD), grouped by model, key, team, day or version."""
    if ctx.invoked_subcommand is not None:
        return
    with api_errors(), common.client() as c:
        result = c.get("/v1/usage", group_by=group_by, start=start, end=end, tenant_id=tenant)
    if as_json:
        print_json(result)
        return
    groups: list[dict[str, Any]] = result["data"]
    keys = [k for k in (groups[0] if groups else {}) if k not in (*_NUMBERS, "cost_micro_usd")]
    keys = keys or [group_by]
    columns = [(k.upper(), field(k)) for k in keys] + [
        (k.upper().replace("_", " "), field(k)) for k in _NUMBERS
    ]
    title = f"Usage {when(result['start'])} → {when(result['end'])} by {group_by}"
    totals = {keys[0]: "total", **result["totals"]}
    show([*groups, totals], columns, title, False)


_NUMBERS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "total_tokens",
            "cost_usd")  # fmt: skip


@usage_app.command("export")
def usage_export(
    start: Start = None,
    end: End = None,
    tenant: TenantOpt = None,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="File (default: stdout).")
    ] = None,
) -> None:
    """Every request's usage row as CSV."""
    with api_errors(), common.client() as c:
        csv = c.text("/v1/usage/export", start=start, end=end, tenant_id=tenant)
    if output is None:
        sys.stdout.write(csv)
    else:
        output.write_text(csv)
        console.print(f"wrote {output}")
