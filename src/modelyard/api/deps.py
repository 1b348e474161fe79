"""FastAPI dependencies shared by the platform's routers: the platform and the caller.

The caller is authenticated (and the route's scope checked) by `api.preauth.PreAuthenticate`
before any body is read; these dependencies hand that principal to the handler. They also
declare bearer auth in the OpenAPI schema (`HTTPBearer`), so `/docs` can send a key.
"""

from __future__ import annotations

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from modelyard.core.identity import Principal
from modelyard.platform import Platform

# auto_error=False: the 401 is ours (OpenAI's shape), not FastAPI's 403.
bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer sk-my-…`.")


def get_platform(request: Request) -> Platform:
    platform: Platform = request.app.state.platform
    return platform


async def get_principal(
    request: Request,
    _: HTTPAuthorizationCredentials | None = Security(bearer),
) -> Principal:
    principal: Principal | None = getattr(request.state, "principal", None)
    if principal is not None:  # authenticated before the body was read
        return principal
    return await get_platform(request).auth.authenticate(request.headers.get("authorization"))


async def get_admin(principal: Principal = Depends(get_principal)) -> Principal:
    principal.require("admin")
    return principal


async def get_inference(principal: Principal = Depends(get_principal)) -> Principal:
    principal.require("inference")
    return principal


# The scope each dependency demands, so the pre-authentication can check it before the body.
SCOPE_OF_DEPENDENCY = {get_admin: "admin", get_inference: "inference"}


def base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")
