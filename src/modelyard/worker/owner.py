"""The replica's side of its owner's heartbeat (`core/owner_watch.py`): the route the leading
controller calls (`PUT /admin/owner`, behind the worker token like every route but /health)
and the watchdog it feeds."""

from __future__ import annotations

from fastapi import FastAPI

from modelyard.core.owner_watch import HEARTBEAT_PATH, OwnerWatch, configured_timeout
from modelyard.protocol.responses import JSONResponse


def install_owner_watch(app: FastAPI, timeout_s: float | None = None) -> OwnerWatch | None:
    """Add the heartbeat route to `app`; returns the watchdog (None without a timeout, given or
    from the environment), which the app's lifespan starts once it serves."""
    timeout_s = timeout_s if timeout_s is not None else configured_timeout()
    watch = OwnerWatch(timeout_s) if timeout_s else None
    app.state.owner_watch = watch

    @app.put(HEARTBEAT_PATH)
    async def owner_heartbeat() -> JSONResponse:
        if watch is not None:
            watch.heard()
        return JSONResponse({"watched": watch is not None})

    return watch
