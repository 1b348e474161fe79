"""The tenant's webhook signing secret: read it (made on first use) and rotate it.

Any key of the tenant with the `inference` or `admin` scope may read it: it only lets the tenant
check webhooks sent to it, never sign another tenant's (each tenant has its own).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends

from modelyard.api.deps import get_services, get_tenant_key
from modelyard.api.services import Services
from modelyard.batch.webhook import tenant_secret
from modelyard.core.identity import Principal

router = APIRouter()


_tenant_key = get_tenant_key


def _view(principal: Principal, secret: str) -> dict[str, Any]:
    return {
        "object": "webhook.secret",
        "tenant_id": principal.tenant_id,
        "secret": secret,
        "format": "standard-webhooks",
    }


@router.get("/v1/webhooks/secret")
async def get_webhook_secret(
    principal: Principal = Depends(_tenant_key),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    """The secret the tenant's batch webhooks are signed with (`whsec_…`, Standard Webhooks)."""
    secret = await asyncio.to_thread(tenant_secret, services.db, principal.tenant_id)
    return _view(principal, secret)


@router.post("/v1/webhooks/secret/rotate")
async def rotate_webhook_secret(
    principal: Principal = Depends(_tenant_key),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    """A new secret; webhooks sent from now on are signed with it only."""
    secret = await asyncio.to_thread(tenant_secret, services.db, principal.tenant_id, True)
    public = {k: v for k, v in _view(principal, secret).items() if k != "secret"}  # never it
    await services.audit.record(
        principal, "tenant.webhook_secret_rotate", "tenant", principal.tenant_id, None, public
    )
    return _view(principal, secret)
