"""The options every modelyard HTTP server (gateway, controller, worker, encoder host) runs
uvicorn with."""

from __future__ import annotations

from typing import Any

from modelyard.config import TelemetrySettings

# How long an idle keep-alive connection stays open. Above the idle expiry of the pools that
# reuse these connections (httpx and the openai SDK: 5 s; aiohttp, the gateway's hop to its
# workers: 15 s; load balancers: 60 s): at uvicorn's own 5 s, a client's pool picks an idle
# connection in the instant the server closes it and the request fails with a read error
# before any byte, which a client without retries reports as a failed request.
KEEP_ALIVE_S = 75


def uvicorn_options(settings: TelemetrySettings) -> dict[str, Any]:
    """uvicorn's own logging (its default colored text in text mode; in JSON mode none of its
    handlers, so its lines reach the root's JSON handler) and the keep-alive above."""
    logging = {"log_config": None} if settings.log_format == "json" else {}
    return {"timeout_keep_alive": KEEP_ALIVE_S, **logging}
