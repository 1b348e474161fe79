"""`Call`: what one proxied request accumulates on its way, from admission (its principal,
route and reservation) through the relay (the token counts its worker reports, its status) to
its settlement (`accounting.py`); and the reading of a worker's usage and errors into it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelyard.core.adapter_affinity import AdapterHint
from modelyard.core.adapter_routes import AdapterTarget
from modelyard.core.cache_routing import CacheHint
from modelyard.core.identity import Principal
from modelyard.core.routing import EndpointRoute
from modelyard.gateway.rate_decision import Decision
from modelyard.protocol.errors import GRAMMAR_FAILED

if TYPE_CHECKING:
    from modelyard.gateway.budgets import BudgetHold
    from modelyard.gateway.metering import UsageEvent

# The rate-limit decision of a request no limits apply to (a batch item, an internal call).
NO_LIMITS = Decision(
    allowed=True,
    reason=None,
    retry_after_s=0.0,
    limit_requests=None,
    remaining_requests=None,
    reset_requests_s=0.0,
    limit_tokens=None,
    remaining_tokens=None,
    reset_tokens_s=0.0,
)


@dataclass
class Call:
    """Everything one proxied request accumulates on its way."""

    principal: Principal
    route: EndpointRoute
    kind: str
    request_id: str
    reserved: int
    decision: Decision
    started: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    status: str = "ok"
    status_code: int = 200
    batch: bool = False  # a batch item: no rate limits, metered as batch
    quota_reserved: int = 0  # monthly quota tokens held since admission
    quota_month: str = ""  # the month they are held in
    slot: bool = False  # holds one of the tenant's concurrent-request slots
    # The settlement (metering or refund), once started: runs to its end whatever the client does.
    closing: asyncio.Task[UsageEvent | None] | None = None
    relaying: bool = False  # the stream's relay has started (and will settle in its `finally`)
    stamped: bool = False  # its stream's events carry the worker's token counts
    # Which version serves it (the replica picked: a canary or the stable one), and the key that
    # keeps a user or session on one version while the weights stay (its `user`, x-session-id).
    version_id: str | None = None
    affinity: str | None = None
    # Its prompt's prefix keys (the replica holding the longest cached prefix), or its adapter.
    prefix: CacheHint | AdapterHint | None = None
    budget: BudgetHold | None = None  # spend held on its budgets since admission
    adapter: AdapterTarget | None = None  # the tenant's registry LoRA adapter it names
    # The client's `<model>:<name>` when it names an adapter of the engine's `lora_dir`
    # (`admission.folder_adapter`): a replica without that folder answers the client's 404.
    folder_model: str | None = None
    local: int = 0  # admitted on this gateway's shares while Redis was away: their generation


def error_status(error: Any) -> str:
    """A usage row's status for an error a replica sent mid-stream: `error` (the replica
    failed: its circuit breaker counts it) or `invalid_request` (the request's own fault, e.g.
    its grammar: the replica is fine)."""
    if not isinstance(error, dict):
        return "error"
    if error.get("type") == "invalid_request_error" or error.get("code") == GRAMMAR_FAILED:
        return "invalid_request"
    return "error"


def take_usage(call: Call, usage: dict[str, Any]) -> None:
    # Chat and completions name them prompt/completion tokens, the Responses API input/output.
    call.prompt_tokens = int(
        usage.get("prompt_tokens", usage.get("input_tokens", call.prompt_tokens))
    )
    call.completion_tokens = int(
        usage.get("completion_tokens", usage.get("output_tokens", call.completion_tokens))
    )
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    call.cached_tokens = int(details.get("cached_tokens") or 0)
