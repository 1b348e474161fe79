"""FastAPI dependencies shared by the platform's routers: the services and the caller.

The caller is authenticated (and the route's scope checked) by `api.preauth.PreAuthenticate`
before any body is read; these dependencies hand that principal to the handler. They also
declare bearer auth in the OpenAPI schema (`HTTPBearer`), so `/docs` can send a key.
"""

from __future__ import annotations

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from modelyard.api.services import Services
from modelyard.core.identity import Principal
from modelyard.core.roles import DEPLOYERS, KEY_OWNERS, READ, TENANT_READERS

# auto_error=False: the 401 is ours (OpenAI's shape), not FastAPI's 403.
bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer sk-my-…`.")


def get_services(request: Request) -> Services:
    """The services the composition root handed to `create_platform_app`."""
    services: Services = request.app.state.services
    return services


async def get_principal(
    request: Request,
    _: HTTPAuthorizationCredentials | None = Security(bearer),
) -> Principal:
    principal: Principal | None = getattr(request.state, "principal", None)
    if principal is not None:  # authenticated before the body was read
        return principal
    return await get_services(request).auth.authenticate(request.headers.get("authorization"))


async def get_admin(principal: Principal = Depends(get_principal)) -> Principal:
    principal.require("admin")
    return principal


async def get_inference(principal: Principal = Depends(get_principal)) -> Principal:
    principal.require("inference")
    return principal


async def get_reader(principal: Principal = Depends(get_principal)) -> Principal:
    """A caller that may read its tenant's configuration (endpoints, models): admin or
    inference, or a user's `read` (a viewer). A metrics-only key reads `/metrics` only."""
    principal.require_any(READER_SCOPES)
    return principal


async def get_tenant_key(principal: Principal = Depends(get_principal)) -> Principal:
    """A key that works for the tenant (admin or inference; no viewer): webhook secrets."""
    principal.require_any(WORKER_SCOPES)
    return principal


async def get_tenant_reader(principal: Principal = Depends(get_principal)) -> Principal:
    """A reader of the tenant's records (registry, usage, users, teams): admin or `read`."""
    principal.require_any(TENANT_READERS)
    return principal


async def get_deployer(principal: Principal = Depends(get_principal)) -> Principal:
    """A caller that may deploy and push models: admin, or a user's `deploy` (a developer)."""
    principal.require_any(DEPLOYERS)
    return principal


async def get_key_owner(principal: Principal = Depends(get_principal)) -> Principal:
    """A caller that may manage API keys: every key of the tenant (admin), or its own
    (`own_keys`, a developer); `control/tenancy.py` tells which."""
    principal.require_any(KEY_OWNERS)
    return principal


WORKER_SCOPES = ("admin", "inference")
READER_SCOPES = ("admin", "inference", READ)

# The scopes each dependency accepts (any one of them), so the pre-authentication can check
# them before the body.
SCOPE_OF_DEPENDENCY: dict[object, tuple[str, ...]] = {
    get_admin: ("admin",),
    get_inference: ("inference",),
    get_reader: READER_SCOPES,
    get_tenant_key: WORKER_SCOPES,
    get_tenant_reader: TENANT_READERS,
    get_deployer: DEPLOYERS,
    get_key_owner: KEY_OWNERS,
}


def base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")
