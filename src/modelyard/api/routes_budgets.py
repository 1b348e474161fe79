"""Prices and budgets in dollars: the management API's routes.

Each route parses its body (unknown fields refused, amounts bounded) and answers with what the
prices and budgets service (`control/budgets.py`) returns; a budget's view adds its current
period's spend, read from the gateways' shared counters (`gateway/budgets.py`). A budget's
`webhook_url` must pass the platform's webhook policy (`batch_webhook_hosts`), like a batch's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Query

from modelyard.api.deps import get_admin, get_reader, get_services
from modelyard.api.services import Services
from modelyard.batch.webhook_policy import WebhookPolicy, WebhookRefused
from modelyard.control.budgets import Budgets, budget_view
from modelyard.core.errors import Invalid, NotFound, Unavailable
from modelyard.core.identity import Principal
from modelyard.core.pricing import usd
from modelyard.gateway.budgets import BudgetBook, budget_of
from modelyard.protocol.budgets import BudgetCreate, BudgetUpdate, PriceSet
from modelyard.protocol.responses import JSONResponse
from modelyard.store.budget_tables import BudgetRow

router = APIRouter()


def _budgets(services: Services) -> Budgets:
    if services.budgets is None:
        raise Unavailable("Budgets are not served here.", code="not_available")
    return services.budgets


def _book(services: Services) -> BudgetBook:
    book = services.gateway.accounting.budgets
    if book is None:
        raise Unavailable("Budgets are not served here.", code="not_available")
    return book


async def _check_webhook(services: Services, url: str | None) -> None:
    if not url:
        return
    policy = WebhookPolicy(services.settings.batch_webhook_hosts)
    try:
        await asyncio.to_thread(policy.check, url)
    except WebhookRefused as exc:
        raise Invalid(f"webhook_url is refused: {exc}", param="webhook_url",
                      code="invalid_webhook_url") from exc  # fmt: skip


async def _with_spend(services: Services, found: list[BudgetRow]) -> list[dict[str, Any]]:
    current = await _book(services).current([budget_of(b) for b in found])
    views = []
    for row, (key, spent) in zip(found, current, strict=True):
        view = budget_view(row)
        view.update(period_key=key, spent_usd=usd(spent), spent_micro_usd=spent)
        views.append(view)
    return views


_OWNER = Query(None, max_length=64, description="Platform admin only: the adapter's tenant.")


@router.put("/v1/prices/adapters/{name}")
async def set_adapter_price(
    name: str,
    body: PriceSet,
    tenant_id: str | None = _OWNER,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    """A registry LoRA adapter's own prices (all its versions; USD per 1M tokens, batch
    discount): a call naming it costs these instead of its base endpoint's. The platform admin
    or an admin of the adapter's tenant."""
    return await _budgets(services).set_adapter_price(principal, name, body, tenant_id)


@router.get("/v1/prices/adapters/{name}")
async def get_adapter_price(
    name: str,
    tenant_id: str | None = _OWNER,
    principal: Principal = Depends(get_reader),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    """An adapter's own prices; `priced` false: its calls cost its base endpoint's."""
    return await _budgets(services).get_adapter_price(principal, name, tenant_id)


@router.delete("/v1/prices/adapters/{name}")
async def delete_adapter_price(
    name: str,
    tenant_id: str | None = _OWNER,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    """Remove an adapter's own prices: its calls cost its base endpoint's again."""
    return await _budgets(services).delete_adapter_price(principal, name, tenant_id)


@router.put("/v1/prices/{endpoint}")
async def set_price(
    endpoint: str,
    body: PriceSet,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    """An endpoint's prices (USD per 1M tokens, batch discount); the platform admin or an
    admin of the endpoint's tenant."""
    return await _budgets(services).set_price(principal, endpoint, body)


@router.get("/v1/prices/{endpoint}")
async def get_price(
    endpoint: str,
    principal: Principal = Depends(get_reader),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await _budgets(services).get_price(principal, endpoint)


@router.post("/v1/budgets", status_code=201)
async def create_budget(
    body: BudgetCreate,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> JSONResponse:
    await _check_webhook(services, body.webhook_url)
    view = await _budgets(services).create_budget(principal, body)
    return JSONResponse(view, status_code=201)


@router.get("/v1/budgets")
async def list_budgets(
    tenant_id: str | None = Query(None, max_length=64, description="Platform admin only."),
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    found = await _budgets(services).list_budgets(principal, tenant_id)
    return {"object": "list", "data": await _with_spend(services, found)}


@router.get("/v1/budgets/{budget_id}")
async def get_budget(
    budget_id: str,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    found = await _budgets(services).list_budgets(principal, None)
    match = [b for b in found if b.id == budget_id]
    if not match:
        raise NotFound(f"No budget {budget_id[:100]!r}.", code="not_found")
    return (await _with_spend(services, match))[0]


@router.patch("/v1/budgets/{budget_id}")
async def update_budget(
    budget_id: str,
    body: BudgetUpdate,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    await _check_webhook(services, body.webhook_url)
    return await _budgets(services).update_budget(principal, budget_id, body)


@router.delete("/v1/budgets/{budget_id}")
async def delete_budget(
    budget_id: str,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await _budgets(services).delete_budget(principal, budget_id)
