"""`modelyard budgets …` and `modelyard prices …`: budgets in dollars, endpoints' prices and
registry LoRA adapters' own prices (`modelyard prices adapter …`).

Amounts are passed on as typed (decimal strings): the platform parses them into exact
micro-dollars and refuses what is out of bounds."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote, urlencode

import typer

from modelyard.cli_commands import common
from modelyard.cli_commands.output import api_errors, details, field, show

budgets_app = typer.Typer(no_args_is_help=True, help="Budgets in dollars (tenant, key, team).")
prices_app = typer.Typer(no_args_is_help=True, help="An endpoint's prices (USD per 1M tokens).")
adapter_prices_app = typer.Typer(
    no_args_is_help=True,
    help="A registry LoRA adapter's own prices (else its calls cost its base endpoint's).",
)
prices_app.add_typer(adapter_prices_app, name="adapter")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
Dollars = Annotated[str | None, typer.Option(help="USD, e.g. 25 or 0.5.")]
InputPrice = Annotated[str, typer.Option("--input", help="USD per 1M prompt tokens.")]
OutputPrice = Annotated[str, typer.Option("--output", help="USD per 1M completion tokens.")]
CachedPrice = Annotated[
    str | None, typer.Option(help="USD per 1M cached prompt tokens (default: --input).")
]
BatchDiscount = Annotated[str, typer.Option(help="Percent off batch items.")]
AdapterOwner = Annotated[str | None, typer.Option(help="Platform admin: the adapter's tenant.")]

BUDGET_COLUMNS = [
    ("ID", field("id")),
    ("SCOPE", field("scope")),
    ("SUBJECT", field("subject_id")),
    ("PERIOD", field("period")),
    ("NOW", field("period_key")),
    ("SPENT $", field("spent_usd")),
    ("SOFT $", field("soft_limit_usd")),
    ("LIMIT $", field("limit_usd")),
]


def _given(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


@budgets_app.command("list")
def budgets_list(
    tenant: Annotated[str | None, typer.Option(help="Platform admin: a tenant's.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Budgets with their current period's spend (billed plus held by requests in flight)."""
    with api_errors(), common.client() as c:
        show(c.get("/v1/budgets", tenant_id=tenant)["data"], BUDGET_COLUMNS, "Budgets", as_json)


@budgets_app.command("create")
def budgets_create(
    scope: Annotated[str, typer.Argument(help="tenant, key or team.")],
    limit: Annotated[str, typer.Option(help="Hard limit in USD (429 budget_exceeded).")],
    subject: Annotated[str | None, typer.Option(help="The key or team id.")] = None,
    period: Annotated[str, typer.Option(help="day or month (UTC).")] = "month",
    soft: Dollars = None,
    webhook_url: Annotated[str | None, typer.Option(help="Where the soft alert goes.")] = None,
    tenant: Annotated[str | None, typer.Option(help="Platform admin: whose budget.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a budget (a tenant's own: the platform admin only)."""
    body = _given(scope=scope, subject_id=subject, period=period, limit_usd=limit,
                  soft_limit_usd=soft, webhook_url=webhook_url, tenant_id=tenant)  # fmt: skip
    with api_errors(), common.client() as c:
        details(c.post("/v1/budgets", body), as_json)


@budgets_app.command("update")
def budgets_update(
    budget_id: str,
    limit: Dollars = None,
    soft: Dollars = None,
    webhook_url: Annotated[str | None, typer.Option(help="Where the soft alert goes.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Change a budget's limits or webhook (only the options given)."""
    body = _given(limit_usd=limit, soft_limit_usd=soft, webhook_url=webhook_url)
    with api_errors(), common.client() as c:
        details(c.patch(f"/v1/budgets/{budget_id}", body), as_json)


@budgets_app.command("delete")
def budgets_delete(budget_id: str, as_json: JsonFlag = False) -> None:
    """Remove a budget."""
    with api_errors(), common.client() as c:
        details(c.delete(f"/v1/budgets/{budget_id}"), as_json)


@prices_app.command("show")
def prices_show(endpoint: str, as_json: JsonFlag = False) -> None:
    """An endpoint's prices (by id, or the model name of one of yours)."""
    with api_errors(), common.client() as c:
        details(c.get(f"/v1/prices/{endpoint}"), as_json)


@prices_app.command("set")
def prices_set(
    endpoint: str,
    input_price: InputPrice = "0",
    output_price: OutputPrice = "0",
    cached_input: CachedPrice = None,
    batch_discount: BatchDiscount = "0",
    as_json: JsonFlag = False,
) -> None:
    """Set an endpoint's prices (its tenant's admin or the platform admin)."""
    body = _price_body(input_price, output_price, cached_input, batch_discount)
    with api_errors(), common.client() as c:
        details(c.put(f"/v1/prices/{endpoint}", body), as_json)


def _price_body(input_price: str, output_price: str, cached: str | None, batch: str) -> (
    dict[str, Any]
):  # fmt: skip
    return _given(input_usd_per_million=input_price, output_usd_per_million=output_price,
                  cached_input_usd_per_million=cached,
                  batch_discount_percent=batch)  # fmt: skip


def _adapter_path(name: str, tenant: str | None) -> str:
    query = f"?{urlencode({'tenant_id': tenant})}" if tenant else ""
    return f"/v1/prices/adapters/{quote(name, safe='')}{query}"


@adapter_prices_app.command("show")
def adapter_prices_show(name: str, tenant: AdapterOwner = None, as_json: JsonFlag = False) -> None:
    """A registry adapter's own prices (`priced` false: its base endpoint's apply)."""
    with api_errors(), common.client() as c:
        details(c.get(_adapter_path(name, tenant)), as_json)


@adapter_prices_app.command("set")
def adapter_prices_set(
    name: str,
    input_price: InputPrice = "0",
    output_price: OutputPrice = "0",
    cached_input: CachedPrice = None,
    batch_discount: BatchDiscount = "0",
    tenant: AdapterOwner = None,
    as_json: JsonFlag = False,
) -> None:
    """Set a registry adapter's prices, all its versions (its tenant's admin or the platform
    admin): a call naming it costs these instead of its base endpoint's."""
    body = _price_body(input_price, output_price, cached_input, batch_discount)
    with api_errors(), common.client() as c:
        details(c.put(_adapter_path(name, tenant), body), as_json)


@adapter_prices_app.command("clear")
def adapter_prices_clear(name: str, tenant: AdapterOwner = None, as_json: JsonFlag = False) -> None:
    """Remove a registry adapter's own prices: its calls cost its base endpoint's again."""
    with api_errors(), common.client() as c:
        details(c.delete(_adapter_path(name, tenant)), as_json)
