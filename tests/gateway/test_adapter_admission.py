"""`<base>:<adapter>` at the gateway's admission (`gateway/admission.py`): the name after the
colon is the calling tenant's registry adapter on that base, or, on an endpoint whose engine
has a `lora_dir` of its own, a folder there the worker looks up; anything else (another
tenant's adapter, no adapter at all, an internal name) is refused as an unknown model is, with
the same 404 and words, before any replica is asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelyard.config import PlatformSettings
from modelyard.core.adapter_routes import internal_name
from modelyard.core.errors import NotFound
from modelyard.core.identity import Limits, Principal
from modelyard.core.routing import EndpointRoute, RoutingTable
from modelyard.gateway.accounting import Accounting
from modelyard.gateway.admission import Admission
from modelyard.gateway.metering import UsageRecorder
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quota import MemoryConcurrencyLimiter, MemoryQuotaCounter
from modelyard.gateway.ratelimit import MemoryRateLimiter
from modelyard.store.db import Database


def _principal(tenant_id: str) -> Principal:
    return Principal(
        key_id=f"k-{tenant_id}", key_name="k", tenant_id=tenant_id, tenant_name=tenant_id,
        scopes=frozenset({"inference"}), limits=Limits(None, None), monthly_token_quota=None,
        platform_admin=False,
    )  # fmt: skip


def _refusal(admission: Admission, tenant_id: str, model: str) -> tuple[str, ...]:
    """What the client reads of a refusal (its status comes of its kind at the edge), the
    name it sent left out."""
    with pytest.raises(NotFound) as refused:
        admission.resolve(_principal(tenant_id), model, "chat.completions")
    exc = refused.value
    return exc.kind, str(exc.code), str(exc.param), exc.message.replace(f"`{model}`", "`?`")


def test_only_the_callers_own_adapter_passes_through_its_base(tmp_path: Path) -> None:
    routing = RoutingTable()
    public = EndpointRoute("ep-pub", "tn-sys", "smollm2", True, "mv-base", 64)
    routing.publish(public)
    bob_bot = internal_name("tn-bob", "mv-0b")
    routing.set_adapters(
        public, {("tn-alice", "support-bot"): {1: internal_name("tn-alice", "mv-0a")},
                 ("tn-bob", "legal-bot"): {1: bob_bot}},
    )  # fmt: skip
    db = Database(f"sqlite:///{tmp_path / 'usage.db'}")
    accounting = Accounting(
        MemoryRateLimiter(), MemoryQuotaCounter(), MemoryConcurrencyLimiter(), UsageRecorder(db),
        GatewayMetrics(),
    )  # fmt: skip
    admission = Admission(PlatformSettings(data_dir=tmp_path), routing, accounting)
    alice = _principal("tn-alice")
    assert admission.resolve(alice, "smollm2:support-bot", "chat.completions") is public
    assert admission.resolve(alice, "support-bot", "completions") is public
    unknown = _refusal(admission, "tn-alice", "no-such-model")
    assert unknown[:3] == ("not_found", "model_not_found", "model")
    # Bob's adapter through the base, a name nobody has, an empty one, an internal name: each
    # answers what an unknown model answers, whatever the route.
    for model in ("smollm2:legal-bot", "smollm2:no-such-adapter", "smollm2:", "ep-pub:legal-bot",
                  f"smollm2:{bob_bot}", "smollm2:support-bot:1"):  # fmt: skip
        for kind in ("chat.completions", "completions", "responses"):
            with pytest.raises(NotFound):
                admission.resolve(alice, model, kind)
        assert _refusal(admission, "tn-alice", model) == unknown, model
    assert admission.resolve(_principal("tn-bob"), "smollm2:legal-bot") is public
    # An endpoint whose engine reads a `lora_dir`: its worker knows that folder's names.
    public.lora_dir = True
    assert admission.resolve(alice, "smollm2:from-lora-dir", "completions") is public
    assert _refusal(admission, "tn-alice", f"smollm2:{bob_bot}") == unknown
    db.dispose()
