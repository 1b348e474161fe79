"""Route tables built before the first request: FastAPI (0.16x) builds each included router's
route contexts (dependencies, parameter models) lazily, on the first request that walks past
them. For the platform's few hundred routes that is a quarter of a second of pure Python on a
loaded machine, on the event loop, in the middle of someone's request; `warm_routes` builds
them at startup instead, on a thread (FastAPI guards the build with a lock and caches it).
On a FastAPI without lazy route contexts it does nothing."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI


def warm_routes(app: FastAPI) -> int:
    """Build the route contexts of every included router of `app`; how many were built."""
    return sum(_warm(route) for route in app.router.routes)


def _warm(node: Any) -> int:
    candidates = getattr(node, "effective_candidates", None)
    if candidates is None:
        return 0
    built = 0
    for candidate in candidates():
        built += 1 + _warm(candidate)
    low_priority = getattr(node, "effective_low_priority_routes", None)
    if low_priority is not None:
        built += len(low_priority())
    return built
