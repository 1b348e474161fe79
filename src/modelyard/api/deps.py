"""FastAPI dependencies shared by the platform's routers: the platform and the caller."""

from __future__ import annotations

from fastapi import Request

from modelyard.gateway.auth import Principal
from modelyard.platform import Platform


def get_platform(request: Request) -> Platform:
    platform: Platform = request.app.state.platform
    return platform


async def get_principal(request: Request) -> Principal:
    platform = get_platform(request)
    return await platform.auth.authenticate(request.headers.get("authorization"))


async def get_admin(request: Request) -> Principal:
    principal = await get_principal(request)
    principal.require("admin")
    return principal


def base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")
