"""Prices and budgets in dollars: who may set them, their bounds, and the audit of each change.

An endpoint's prices are set by the platform admin or by an admin of the endpoint's tenant (the
model's owner). A registry LoRA adapter's prices (all its versions) are set by the platform admin
or an admin of the adapter's tenant; a call naming the adapter costs them, else its base
endpoint's (`gateway/budgets.py`). A tenant's own budget (scope `tenant`) is the platform
admin's to set, like its quota; budgets of a key or a team are set by the tenant's admins (or
the platform admin). Every amount is parsed into exact micro-dollars (`core/pricing.py`) and
bounded; a soft limit is at most the hard one. Gateways pick a change up within
`budget_refresh_s` (`on_change` makes this process's apply at once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from modelyard.control.audit import AuditLog, AuditTarget
from modelyard.core.errors import Conflict, Forbidden, Invalid, NotFound
from modelyard.core.identity import Principal
from modelyard.core.pricing import (
    MAX_BUDGET_MICRO,
    MAX_PRICE_MICRO,
    BudgetScope,
    parse_percent_bps,
    parse_usd,
    usd,
)
from modelyard.protocol.budgets import BudgetCreate, BudgetUpdate, PriceSet
from modelyard.store import budgets as rows
from modelyard.store import repository as repo
from modelyard.store.budget_tables import AdapterPriceRow, BudgetRow, ModelPriceRow
from modelyard.store.db import Database
from modelyard.store.people_tables import Team
from modelyard.store.tables import ApiKey, Endpoint, Model, ModelVersion

# Every gateway holds every budget in memory: a tenant's are bounded.
MAX_BUDGETS_PER_TENANT = 1000
# A registry model's name is at most 128 characters (`control/registry.py`).
_NAME_MAX = 128


def _usd(value: object, param: str, maximum: int) -> int:
    try:
        return parse_usd(value, param, maximum)
    except ValueError as exc:
        raise Invalid(str(exc), param=param, code="invalid_value") from exc


def _percent_bps(value: object) -> int:
    try:
        return parse_percent_bps(value, "batch_discount_percent")
    except ValueError as exc:
        raise Invalid(str(exc), param="batch_discount_percent", code="invalid_value") from exc


def price_view(p: ModelPriceRow) -> dict[str, Any]:
    cached = p.cached_input_micro
    return {
        "object": "model.price",
        "endpoint_id": p.endpoint_id,
        "tenant_id": p.tenant_id,
        "input_usd_per_million": usd(p.input_micro),
        "output_usd_per_million": usd(p.output_micro),
        "cached_input_usd_per_million": None if cached is None else usd(cached),
        "batch_discount_percent": str(Decimal(p.batch_discount_bps) / 100),
        "updated_at": int(repo.as_utc(p.updated_at).timestamp()),
    }


def _price_values(body: PriceSet) -> dict[str, int | None]:
    """A price body as micro-dollars and basis points, each bounded (`Invalid` naming it)."""
    cached = body.cached_input_usd_per_million
    return {
        "input_micro": _usd(body.input_usd_per_million, "input_usd_per_million",
                            MAX_PRICE_MICRO),
        "output_micro": _usd(body.output_usd_per_million, "output_usd_per_million",
                             MAX_PRICE_MICRO),
        "cached_input_micro": None if cached is None else _usd(
            cached, "cached_input_usd_per_million", MAX_PRICE_MICRO),
        "batch_discount_bps": _percent_bps(body.batch_discount_percent),
    }  # fmt: skip


def _set_price(row: ModelPriceRow | AdapterPriceRow, values: dict[str, int | None]) -> None:
    for k, v in values.items():
        setattr(row, k, v)
    row.updated_at = repo.now()


def adapter_price_view(model: Model, p: AdapterPriceRow | None) -> dict[str, Any]:
    """An adapter's prices; `priced` false (every amount null): its base endpoint's apply."""
    cached = None if p is None else p.cached_input_micro
    return {
        "object": "adapter.price",
        "adapter": model.name,
        "model_id": model.id,
        "tenant_id": model.tenant_id,
        "priced": p is not None,
        "input_usd_per_million": None if p is None else usd(p.input_micro),
        "output_usd_per_million": None if p is None else usd(p.output_micro),
        "cached_input_usd_per_million": None if cached is None else usd(cached),
        "batch_discount_percent": None if p is None else str(Decimal(p.batch_discount_bps) / 100),
        "updated_at": None if p is None else int(repo.as_utc(p.updated_at).timestamp()),
    }


def budget_view(b: BudgetRow) -> dict[str, Any]:
    soft = b.soft_limit_micro
    return {
        "object": "budget",
        "id": b.id,
        "tenant_id": b.tenant_id,
        "scope": b.scope,
        "subject_id": b.subject_id,
        "period": b.period,
        "limit_usd": usd(b.limit_micro),
        "limit_micro_usd": b.limit_micro,
        "soft_limit_usd": None if soft is None else usd(soft),
        "soft_limit_micro_usd": soft,
        "webhook_url": b.webhook_url,
        "created_at": int(repo.as_utc(b.created_at).timestamp()),
    }


class Budgets:
    def __init__(self, db: Database, audit: AuditLog, on_change: Callable[[], None]) -> None:
        self.db = db
        self.audit = audit
        self.on_change = on_change

    # ----- prices -----------------------------------------------------------------------------

    def _endpoint(self, s: Session, principal: Principal, endpoint: str) -> Endpoint:
        row = s.get(Endpoint, endpoint)
        if row is None:  # the caller's own endpoint by its model name
            row = repo.live_endpoint_by_name(s, principal.tenant_id, endpoint)
        if row is None or row.deleted_at is not None:
            raise NotFound(f"No endpoint {endpoint!r}.", code="not_found")
        if not principal.platform_admin and row.tenant_id != principal.tenant_id:
            raise NotFound(f"No endpoint {endpoint!r}.", code="not_found")
        return row

    async def set_price(
        self, principal: Principal, endpoint: str, body: PriceSet
    ) -> dict[str, Any]:
        values = _price_values(body)

        def write() -> tuple[dict[str, Any] | None, dict[str, Any]]:
            with self.db.session() as s:
                ep = self._endpoint(s, principal, endpoint)
                row = s.get(ModelPriceRow, ep.id, with_for_update=True)
                before = None if row is None else price_view(row)
                if row is None:
                    row = ModelPriceRow(endpoint_id=ep.id, tenant_id=ep.tenant_id)
                    s.add(row)
                _set_price(row, values)
                s.flush()
                return before, price_view(row)

        before, after = await asyncio.to_thread(write)
        await self.audit.record(principal, "model_price.set", "endpoint", after["endpoint_id"],
                                before, after, tenant_id=after["tenant_id"])  # fmt: skip
        self.on_change()
        return after

    async def get_price(self, principal: Principal, endpoint: str) -> dict[str, Any]:
        def read() -> dict[str, Any]:
            with self.db.session() as s:
                ep = self._endpoint(s, principal, endpoint)
                row = s.get(ModelPriceRow, ep.id)
                if row is None:  # never priced: free
                    row = ModelPriceRow(endpoint_id=ep.id, tenant_id=ep.tenant_id, input_micro=0,
                                        output_micro=0, batch_discount_bps=0,
                                        updated_at=ep.created_at)  # fmt: skip
                return price_view(row)

        return await asyncio.to_thread(read)

    # ----- adapters' prices -------------------------------------------------------------------

    def _adapter(self, s: Session, principal: Principal, name: str, tenant_id: str | None) -> Model:
        """The registry LoRA adapter `name` of the caller's tenant (the platform admin: of
        `tenant_id`, else its own); another tenant's, or a model that is no adapter, is not
        found."""
        owner = principal.tenant_filter(tenant_id) or principal.tenant_id
        model = repo.get_model(s, owner, name) if len(name) <= _NAME_MAX else None
        lora = model is not None and s.scalar(
            select(ModelVersion.id)
            .where(ModelVersion.model_id == model.id, ModelVersion.format == "lora")
            .limit(1)
        )
        if model is None or not lora:
            raise NotFound(f"No adapter {name[:_NAME_MAX]!r}.", code="not_found")
        return model

    async def set_adapter_price(
        self, principal: Principal, name: str, body: PriceSet, tenant_id: str | None
    ) -> dict[str, Any]:
        values = _price_values(body)

        def write() -> tuple[dict[str, Any], dict[str, Any]]:
            with self.db.session() as s:
                model = self._adapter(s, principal, name, tenant_id)
                row = s.get(AdapterPriceRow, model.id, with_for_update=True)
                before = adapter_price_view(model, row)
                if row is None:
                    row = AdapterPriceRow(model_id=model.id, tenant_id=model.tenant_id)
                    s.add(row)
                _set_price(row, values)
                s.flush()
                return before, adapter_price_view(model, row)

        before, after = await asyncio.to_thread(write)
        await self.audit.record(principal, "adapter_price.set", AuditTarget.MODEL,
                                after["model_id"], before, after,
                                tenant_id=after["tenant_id"])  # fmt: skip
        self.on_change()
        return after

    async def get_adapter_price(
        self, principal: Principal, name: str, tenant_id: str | None
    ) -> dict[str, Any]:
        def read() -> dict[str, Any]:
            with self.db.session() as s:
                model = self._adapter(s, principal, name, tenant_id)
                return adapter_price_view(model, s.get(AdapterPriceRow, model.id))

        return await asyncio.to_thread(read)

    async def delete_adapter_price(
        self, principal: Principal, name: str, tenant_id: str | None
    ) -> dict[str, Any]:
        """The adapter's own prices removed: its calls cost its base endpoint's again."""

        def write() -> tuple[dict[str, Any], dict[str, Any]]:
            with self.db.session() as s:
                model = self._adapter(s, principal, name, tenant_id)
                row = s.get(AdapterPriceRow, model.id, with_for_update=True)
                before = adapter_price_view(model, row)
                if row is not None:
                    s.delete(row)
                return before, adapter_price_view(model, None)

        before, after = await asyncio.to_thread(write)
        if before["priced"]:
            await self.audit.record(principal, "adapter_price.delete", AuditTarget.MODEL,
                                    after["model_id"], before, after,
                                    tenant_id=after["tenant_id"])  # fmt: skip
            self.on_change()
        return after

    # ----- budgets ----------------------------------------------------------------------------

    def _subject(self, s: Session, principal: Principal, tenant_id: str, body: BudgetCreate) -> str:
        scope = BudgetScope(body.scope)
        if scope is BudgetScope.TENANT:
            if not principal.platform_admin:
                raise Forbidden("Only the platform administrator sets a tenant's own budget.",
                                code="insufficient_scope")  # fmt: skip
            if body.subject_id not in (None, tenant_id):
                raise Invalid("a tenant budget's subject is its tenant", param="subject_id")
            return tenant_id
        if body.subject_id is None:
            raise Invalid(f"a {body.scope} budget needs subject_id", param="subject_id")
        owner: ApiKey | Team | None = (
            s.get(ApiKey, body.subject_id)
            if scope is BudgetScope.KEY
            else s.get(Team, body.subject_id)
        )
        if owner is None or owner.tenant_id != tenant_id:  # a team of another tenant too
            raise NotFound(f"No {body.scope} {body.subject_id!r}.", param="subject_id")
        return body.subject_id

    def _amounts(self, limit: object, soft: object) -> tuple[int, int | None]:
        hard = _usd(limit, "limit_usd", MAX_BUDGET_MICRO)
        soft_micro = None if soft is None else _usd(soft, "soft_limit_usd", MAX_BUDGET_MICRO)
        if soft_micro is not None and soft_micro > hard:
            raise Invalid("soft_limit_usd must not be above limit_usd", param="soft_limit_usd")
        return hard, soft_micro

    async def create_budget(self, principal: Principal, body: BudgetCreate) -> dict[str, Any]:
        tenant_id = principal.tenant_filter(body.tenant_id) or principal.tenant_id
        hard, soft = self._amounts(body.limit_usd, body.soft_limit_usd)

        def write() -> dict[str, Any]:
            with self.db.session() as s:
                if repo.get_tenant(s, tenant_id) is None:
                    raise NotFound("No such tenant.", param="tenant_id")
                subject = self._subject(s, principal, tenant_id, body)
                held = s.scalar(select(func.count()).where(BudgetRow.tenant_id == tenant_id))
                if (held or 0) >= MAX_BUDGETS_PER_TENANT:
                    raise Conflict(
                        f"This tenant has {MAX_BUDGETS_PER_TENANT} budgets, the most it may "
                        "have: delete one first.",
                        code="too_many_budgets",
                    )
                taken = s.scalar(select(BudgetRow.id).where(
                    BudgetRow.tenant_id == tenant_id, BudgetRow.scope == body.scope,
                    BudgetRow.subject_id == subject, BudgetRow.period == body.period,
                ))  # fmt: skip
                if taken is not None:
                    raise Conflict(
                        f"This {body.scope} already has a {body.period} budget ({taken}): "
                        "update it instead.",
                        code="budget_exists",
                    )
                at = repo.now()
                row = BudgetRow(
                    id=repo.new_id("bdg"), tenant_id=tenant_id, scope=body.scope,
                    subject_id=subject, period=body.period, limit_micro=hard,
                    soft_limit_micro=soft, webhook_url=body.webhook_url, created_at=at,
                    updated_at=at,
                )  # fmt: skip
                s.add(row)
                s.flush()
                return budget_view(row)

        view = await asyncio.to_thread(write)
        await self.audit.record(principal, "budget.create", "budget", view["id"], None, view,
                                tenant_id=tenant_id)  # fmt: skip
        self.on_change()
        return view

    def _own(self, s: Session, principal: Principal, budget_id: str) -> BudgetRow:
        row = s.get(BudgetRow, budget_id, with_for_update=True)
        # Another tenant's budget answers as an unknown id does (not "No such tenant."): its
        # id says nothing to whoever guessed it.
        if row is None or not (principal.platform_admin or row.tenant_id == principal.tenant_id):
            raise NotFound(f"No budget {budget_id[:100]!r}.", code="not_found")
        if row.scope == BudgetScope.TENANT and not principal.platform_admin:
            raise Forbidden("Only the platform administrator changes a tenant's own budget.",
                            code="insufficient_scope")  # fmt: skip
        return row

    async def update_budget(
        self, principal: Principal, budget_id: str, body: BudgetUpdate
    ) -> dict[str, Any]:
        given = body.model_fields_set

        def write() -> tuple[dict[str, Any], dict[str, Any]]:
            with self.db.session() as s:
                row = self._own(s, principal, budget_id)
                before = budget_view(row)
                limit = body.limit_usd if body.limit_usd is not None else usd(row.limit_micro)
                soft: object = (
                    body.soft_limit_usd
                    if "soft_limit_usd" in given
                    else (None if row.soft_limit_micro is None else usd(row.soft_limit_micro))
                )
                row.limit_micro, row.soft_limit_micro = self._amounts(limit, soft)
                if "webhook_url" in given:
                    row.webhook_url = body.webhook_url
                row.updated_at = repo.now()
                s.flush()
                return before, budget_view(row)

        before, after = await asyncio.to_thread(write)
        await self.audit.record(principal, "budget.update", "budget", budget_id, before, after,
                                tenant_id=after["tenant_id"])  # fmt: skip
        self.on_change()
        return after

    async def delete_budget(self, principal: Principal, budget_id: str) -> dict[str, Any]:
        def write() -> dict[str, Any]:
            with self.db.session() as s:
                row = self._own(s, principal, budget_id)
                view = budget_view(row)
                s.delete(row)
                return view

        before = await asyncio.to_thread(write)
        await self.audit.record(principal, "budget.delete", "budget", budget_id, before, None,
                                tenant_id=before["tenant_id"])  # fmt: skip
        self.on_change()
        return {"object": "budget.deleted", "id": budget_id, "deleted": True}

    async def list_budgets(self, principal: Principal, tenant_id: str | None) -> list[BudgetRow]:
        scope = principal.tenant_filter(tenant_id)

        def read() -> list[BudgetRow]:
            with self.db.session() as s:
                found = list(rows.budgets_of(s, scope))
                s.expunge_all()
                return found

        return await asyncio.to_thread(read)
