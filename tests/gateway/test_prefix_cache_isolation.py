"""The prefix cache of a public model is no side channel between tenants: through a real
`modelyard serve`, a prompt tenant A sent is a cache hit for A again (`cached_tokens` > 0) but
not for tenant B, even when B sends A's `cache_salt` itself (the gateway overrides it)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from modelyard.config import PrefixCacheScope
from modelyard.gateway.cache_scope import scope_prefix_cache, tenant_cache_salt
from tests.platform_harness import (
    PlatformProcess,
    batch_line,
    create_key,
    create_tenant,
    deploy,
    jsonl,
    read_jsonl,
    wait_batch,
)
from tests.tiny_models import build_model

# Long enough for several full KV blocks (16 tokens each) in the tiny byte-level tokenizer.
SECRET_PROMPT = (
    "Quarterly board memo, confidential: the merger with Northwind closes on the ninth; "
    "announce nothing before the auditors sign, and keep the price at forty-two per share."
)
BATCH_PROMPT = (
    "Draft offer letter, do not forward: senior engineer, start date March third, salary "
    "one hundred sixty thousand, signing bonus twenty thousand, equity vesting over four years."
)
OTHER_PROMPT = (
    "Patient record 5521, private: the biopsy came back benign, follow-up in six months, "
    "no change to the medication, and the family has not been told about the second scan."
)


def _serve(
    tmp_path_factory: pytest.TempPathFactory, extra_env: dict[str, str]
) -> Iterator[PlatformProcess]:
    models = tmp_path_factory.mktemp("models")
    build_model(models / "tiny", "llama")
    env = {
        "MODELYARD_LOCAL_ARTIFACT_ROOTS": json.dumps([str(models)]),
        "MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"}),
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
        "MODELYARD_BATCH_POLL_INTERVAL_S": "0.2",
        **extra_env,
    }
    p = PlatformProcess(tmp_path_factory.mktemp("data"), env).start()
    try:
        # One public endpoint with one replica: every tenant's requests meet in one engine.
        deploy(p.api(), "tiny", str(models / "tiny"), public=True)
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> Iterator[PlatformProcess]:
    """The default scope (`tenant`)."""
    yield from _serve(tmp_path_factory, {})


@pytest.fixture()
def shared_platform(
    tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> Iterator[PlatformProcess]:
    yield from _serve(tmp_path_factory, {"MODELYARD_PREFIX_CACHE_SCOPE": "shared"})


class Tenant:
    def __init__(self, platform: PlatformProcess, name: str) -> None:
        admin = platform.api()
        self.id = create_tenant(admin, name)
        key = create_key(admin, self.id, scopes=["inference"])["key"]
        self.client: openai.OpenAI = platform.openai(key)
        self.http: httpx.Client = platform.api(key)

    def cached_tokens(self, prompt: str = SECRET_PROMPT, **extra: Any) -> int:
        """Send `prompt`; how many of its tokens the prefix cache served."""
        out = self.client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=2,
            temperature=0.0,
            extra_body=extra or None,
        )
        assert out.usage is not None and out.usage.prompt_tokens > 48, out.usage
        details = out.usage.prompt_tokens_details
        return details.cached_tokens or 0 if details else 0

    def cached_completion_tokens(self) -> int:
        r = self.http.post(
            "/v1/completions", json={"model": "tiny", "prompt": SECRET_PROMPT, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        details = r.json()["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


def test_a_tenants_prompt_is_no_cache_hit_for_another_tenant(platform: PlatformProcess) -> None:
    a = Tenant(platform, "prefix-a")
    b = Tenant(platform, "prefix-b")

    assert a.cached_tokens() == 0
    assert a.cached_tokens() > 0  # the cache works within a tenant
    # B sends the very same prompt: nothing in the answer tells it that A sent it.
    assert b.cached_tokens() == 0
    assert b.cached_tokens() > 0  # B has a cache of its own

    # Nor when B names A's namespace itself: the gateway sets the salt, whatever is sent.
    assert a.cached_tokens(OTHER_PROMPT) == 0
    assert b.cached_tokens(OTHER_PROMPT, cache_salt=tenant_cache_salt(a.id)) == 0
    assert b.cached_tokens(OTHER_PROMPT, cache_salt="anything") > 0  # B's own namespace still
    assert a.cached_tokens(OTHER_PROMPT, cache_salt="anything") > 0  # and A's own, for A

    # The completions API goes the same way.
    assert a.cached_completion_tokens() == 0
    assert a.cached_completion_tokens() > 0
    assert b.cached_completion_tokens() == 0


def test_batch_items_get_their_tenants_namespace(platform: PlatformProcess) -> None:
    a = Tenant(platform, "prefix-batch-a")
    b = Tenant(platform, "prefix-batch-b")
    # Two prompts that differ from their first block on, so B's items share nothing either.
    prompts = {"plain": BATCH_PROMPT, "a-salt": "Second draft. " + BATCH_PROMPT}
    for prompt in prompts.values():
        assert a.cached_tokens(prompt) == 0
        assert a.cached_tokens(prompt) > 0

    items = [batch_line(cid, p, max_tokens=2, model="tiny") for cid, p in prompts.items()]
    items[1]["body"]["cache_salt"] = tenant_cache_salt(a.id)  # overridden as well
    upload = b.client.files.create(file=("items.jsonl", io.BytesIO(jsonl(items))), purpose="batch")
    batch = b.client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_batch(b.client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    lines = read_jsonl(b.client, done.output_file_id)
    out = {line["custom_id"]: line["response"] for line in lines}
    for custom_id in prompts:
        response = out[custom_id]
        assert response["status_code"] == 200, response
        usage = response["body"]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0, (custom_id, usage)


def test_a_bad_cache_salt_is_refused_by_name(platform: PlatformProcess) -> None:
    r = platform.api().post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "cache_salt": "x" * 257,
        },
    )
    assert r.status_code == 400, r.text
    assert "cache_salt" in r.text


def test_the_shared_scope_shares_across_tenants(shared_platform: PlatformProcess) -> None:
    a = Tenant(shared_platform, "shared-a")
    b = Tenant(shared_platform, "shared-b")
    assert a.cached_tokens() == 0
    assert b.cached_tokens() > 0  # the operator chose hits over the side channel
    # A client may still keep its prompts to itself with a salt of its own.
    assert b.cached_tokens(OTHER_PROMPT, cache_salt="b-only") == 0
    assert a.cached_tokens(OTHER_PROMPT) == 0
    assert b.cached_tokens(OTHER_PROMPT, cache_salt="b-only") > 0


def test_scopes_set_the_salt_the_worker_sees() -> None:
    payload: dict[str, Any] = {"cache_salt": tenant_cache_salt("victim")}
    scope_prefix_cache(payload, PrefixCacheScope.TENANT, "attacker")
    assert payload["cache_salt"] == tenant_cache_salt("attacker")

    shared: dict[str, Any] = {}
    scope_prefix_cache(shared, PrefixCacheScope.SHARED, "attacker")
    assert "cache_salt" not in shared  # one namespace for everyone
    # A client's own salt still keeps its prompts apart, but can never name a tenant's.
    named: dict[str, Any] = {"cache_salt": tenant_cache_salt("victim")}
    scope_prefix_cache(named, PrefixCacheScope.SHARED, "attacker")
    assert named["cache_salt"] not in (tenant_cache_salt("victim"), None)
    assert PrefixCacheScope("shared") is PrefixCacheScope.SHARED
