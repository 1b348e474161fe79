"""Route tables built before the first request. FastAPI (0.16x) does two things lazily, on the
event loop of the first request that needs them: it builds each included router's route
contexts (dependencies, parameter models), and it reads each endpoint's source file to name it
in error messages (`inspect.getsourcelines`, cached per endpoint). For the platform's few
hundred routes the first is a quarter of a second of pure Python on a loaded machine, and the
second a file read and tokenize per route (278 ms seen on a loaded 2 vCPU), each in the middle
of someone's request. `warm_routes` does both at startup instead, on a thread (FastAPI guards
the build with a lock and caches both), and makes the app's OpenAPI schema there too (made on
the first `/openapi.json` otherwise: 256 ms seen on a platform's loop). On a FastAPI without
the lazy parts it does only the schema."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import fastapi.routing
from fastapi import FastAPI

# FastAPI's own per-endpoint cache of where an endpoint is defined (absent in other versions).
_ENDPOINT_CONTEXT: Callable[[Any], Any] | None = getattr(
    fastapi.routing, "_extract_endpoint_context", None
)


def warm_routes(app: FastAPI) -> int:
    """Build the route contexts of every included router of `app`, name every endpoint's source
    and make the OpenAPI schema (if the app serves one); how many route contexts were built."""
    built = sum(_warm(route) for route in app.router.routes)
    if app.openapi_url:
        app.openapi()
    return built


def _warm(node: Any) -> int:
    _name_endpoint(node)
    candidates = getattr(node, "effective_candidates", None)
    if candidates is None:
        return 0
    built = 0
    for candidate in candidates():
        built += 1 + _warm(candidate)
    low_priority = getattr(node, "effective_low_priority_routes", None)
    if low_priority is not None:
        for route in low_priority():
            _name_endpoint(route)
            built += 1
    return built


def _name_endpoint(route: Any) -> None:
    call = getattr(getattr(route, "dependant", None), "call", None)
    if call is not None and _ENDPOINT_CONTEXT is not None:
        _ENDPOINT_CONTEXT(call)
