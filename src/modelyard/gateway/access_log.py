"""The gateway's access line: one per proxied request (batch items included), logged when the
request is settled (`Accounting.close`), since only then are its tokens, TTFT and latency known.

The line is logger `modelyard.access` at INFO. In JSON mode its fields are: request_id (the
platform's own, the usage row's), client_request_id (what the client sent as `x-request-id`,
if valid), tenant, key_id, endpoint, model, version, kind, status_code, status, served,
prompt/completion/cached tokens, ttft_ms, latency_ms and batch. A request refused before a
worker served it (no replica, queue timeout, the client gone) is logged with `served: false`.
With tracing on, the request's span (if still open) gets the same fields as attributes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from modelyard.core import tracing

if TYPE_CHECKING:
    from modelyard.gateway.call import Call
    from modelyard.gateway.metering import UsageEvent

log = logging.getLogger("modelyard.access")


async def logged(
    call: Call, served: bool, settlement: Awaitable[UsageEvent | None]
) -> UsageEvent | None:
    """Run the request's settlement, then log its access line (also if settling failed)."""
    event: UsageEvent | None = None
    try:
        event = await settlement
        return event
    finally:
        try:
            log_access(call, served, event)
        except Exception:  # a log line never costs a settlement
            log.exception("access line of %s failed", call.request_id)


def access_fields(call: Call, served: bool, event: UsageEvent | None) -> dict[str, Any]:
    p, route = call.principal, call.route
    if event is not None:
        latency_ms, ttft_ms = event.latency_ms, event.ttft_ms
        version = event.version_id
    else:
        latency_ms = (time.perf_counter() - call.started) * 1000
        ttft_ms = None if call.ttft is None else call.ttft * 1000
        version = route.version_id
    return {
        "request_id": call.request_id,
        "tenant": p.tenant_id,
        "key_id": p.key_id,
        "endpoint": route.endpoint_id,
        "model": route.model_name,
        "version": version,
        "kind": call.kind,
        # Not served: the status the client got is the error's, decided above this layer.
        "status_code": call.status_code if served or call.status_code != 200 else None,
        "status": call.status if served else "not_served",
        "served": served,
        "prompt_tokens": call.prompt_tokens,
        "completion_tokens": call.completion_tokens,
        "cached_tokens": call.cached_tokens,
        "ttft_ms": None if ttft_ms is None else round(ttft_ms, 2),
        "latency_ms": round(latency_ms, 2),
        "batch": call.batch,
    }


def log_access(call: Call, served: bool, event: UsageEvent | None) -> None:
    traced = tracing.enabled()
    if not (traced or log.isEnabledFor(logging.INFO)):
        return
    f = access_fields(call, served, event)
    if traced:  # the request's span, if still open, gets the same fields
        tracing.annotate({k: v for k, v in f.items() if k != "request_id"})
    if not log.isEnabledFor(logging.INFO):
        return
    ttft = "" if f["ttft_ms"] is None else f", ttft {f['ttft_ms']:.0f} ms"
    log.info(
        "%s %s %s %s in %.0f ms%s (tokens: prompt %d, completion %d, cached %d; tenant %s, "
        "key %s%s)",
        f["kind"], f["model"], f["status_code"] or "-", f["status"], f["latency_ms"], ttft,
        f["prompt_tokens"], f["completion_tokens"], f["cached_tokens"], f["tenant"],
        f["key_id"], ", batch" if f["batch"] else "",
        extra=f,
    )  # fmt: skip
