"""`modelyard serve` end to end, driven with the official `openai` client and plain HTTP:
deploy, gateway (stream and not), keys and scopes, rate limits, quotas, metering, files and
batches, isolation between tenants, and bad input. Every test runs in both modes users run
(`platform_env`: SQLite with in-memory limits, and PostgreSQL with Redis)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from modelyard.gateway.reservation import reservation_bound
from tests.platform_harness import (
    PlatformProcess,
    batch_line,
    create_key,
    create_tenant,
    deploy,
    jsonl,
    platform_running,
    read_jsonl,
    tiny_models_env,
    usage_rows,
    wait_batch,
    wait_request_ids,
    wait_status,
    wait_usage,
)

MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory,
    models_dir: Path,
    cache_dir: Path,
    platform_env: dict[str, str],
) -> Iterator[PlatformProcess]:
    env = {
        **platform_env,
        **tiny_models_env(models_dir),
        "MODELYARD_BATCH_POLL_INTERVAL_S": "0.2",
        "MODELYARD_PRICES": json.dumps({"tiny": {"input": 1.0, "output": 2.0}}),
    }
    with platform_running(tmp_path_factory.mktemp("data"), env) as p:
        yield p


@pytest.fixture(scope="module")
def admin(platform: PlatformProcess) -> httpx.Client:
    return platform.api()


@pytest.fixture(scope="module")
def tiny(platform: PlatformProcess, admin: httpx.Client, models_dir: Path) -> str:
    """A public endpoint every tenant can use."""
    return deploy(admin, "tiny", str(models_dir / "tiny"), public=True)


class Tenant:
    def __init__(self, platform: PlatformProcess, admin: httpx.Client, name: str, **kw: Any):
        self.id = create_tenant(admin, name, kw.pop("quota", None))
        self.admin_key = create_key(admin, self.id, scopes=["admin", "inference"])["key"]
        self.key = create_key(admin, self.id, scopes=["inference"], **kw)
        self.api = platform.api(self.admin_key)
        self.client = platform.openai(self.key["key"])


_counter = iter(range(10**6))


@pytest.fixture()
def tenant(platform: PlatformProcess, admin: httpx.Client, tiny: str) -> Tenant:
    return Tenant(platform, admin, f"tenant-{next(_counter)}-{time.time_ns()}")


def assert_only_sentinel_metered(http: httpx.Client, tenant: Tenant) -> None:
    """Nothing before this was metered: a good request sent now is the tenant's only usage row
    once its row is written (the writer is asynchronous, so waiting on absence alone proves
    nothing)."""
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                 "max_tokens": 1})  # fmt: skip
    assert r.status_code == 200, r.text
    rows = wait_request_ids(tenant.api, [r.headers["x-request-id"]])
    assert [row["request_id"] for row in rows] == [r.headers["x-request-id"]]


def test_deploy_answers_202_with_the_spec_shape(
    admin: httpx.Client, models_dir: Path, tiny: str
) -> None:
    r = admin.post(
        "/v1/models/deploy",
        json={
            "model_name": "tiny-spec",
            "model_artifact": str(models_dir / "tiny"),
            "framework": "native",
            "hardware": {"gpu_type": "cpu", "gpu_count": 1, "min_replicas": 1, "max_replicas": 2},
            "scaling": {
                "metric": "gpu_utilization",
                "target_value": 70,
                "scale_to_zero": True,
                "scale_to_zero_after_idle_seconds": 300,
            },
        },
    )
    assert r.status_code == 202, r.text
    body = r.json()
    assert set(body) == {"endpoint_id", "status", "estimated_ready_seconds", "endpoint_url"}
    assert body["status"] == "provisioning" and body["endpoint_id"].startswith("ep-")
    assert body["endpoint_url"].endswith(f"/v1/models/{body['endpoint_id']}")
    ready = wait_status(admin, body["endpoint_id"], "ready")
    replica = ready["replicas"]["items"][0]
    assert replica["state"] == "ready" and replica["address"].startswith("http://127.0.0.1:")
    assert ready["scaling"]["metric"] == "gpu_utilization"
    # The endpoint URL names a model the OpenAI API can retrieve.
    assert admin.get(f"/v1/models/{body['endpoint_id']}").json()["id"] == "tiny-spec"
    assert admin.delete(f"/v1/endpoints/{body['endpoint_id']}").status_code == 202
    wait_status(admin, body["endpoint_id"], "gone")


def test_chat_through_the_gateway(tenant: Tenant) -> None:
    raw = tenant.client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert raw.headers["x-request-id"]
    resp = raw.parse()
    assert resp.choices[0].message.content and resp.usage.completion_tokens > 0
    stream = tenant.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content
    assert not any(c.usage and not c.choices for c in chunks)  # no usage chunk unless asked
    # Sampled (temperature 1) from a random model, EOS may come at any token: ignored here, so
    # that exactly max_tokens are generated and counted.
    completion = tenant.client.completions.create(
        model="tiny", prompt="The fox", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 5
    assert [m.id for m in tenant.client.models.list()] == ["tiny"]


def test_sampling_defaults_fill_what_a_request_leaves_out(
    admin: httpx.Client, models_dir: Path, tenant: Tenant
) -> None:
    bad = admin.post(
        "/v1/models/deploy",
        json={
            "model_name": "tiny-hot",
            "model_artifact": str(models_dir / "tiny"),
            "sampling_defaults": {"temperature": 5},
        },
    )
    assert (
        bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_defaults.temperature"
    )
    endpoint_id = deploy(
        admin,
        "tiny-greedy",
        str(models_dir / "tiny"),
        public=True,
        sampling_defaults={"temperature": 0},
    )
    try:
        assert admin.get(f"/v1/endpoints/{endpoint_id}").json()["sampling_defaults"] == {
            "temperature": 0.0
        }
        greedy = (
            tenant.client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=12, temperature=0
            )
            .choices[0]
            .message.content
        )
        # Same weights, no temperature in the request: the endpoint's default makes it greedy.
        defaulted = {
            tenant.client.chat.completions.create(
                model="tiny-greedy", messages=MESSAGES, max_tokens=12, seed=seed
            )
            .choices[0]
            .message.content
            for seed in range(3)
        }
        assert defaulted == {greedy}
        # A request's own temperature wins over the default.
        hot = {
            tenant.client.chat.completions.create(
                model="tiny-greedy", messages=MESSAGES, max_tokens=12, temperature=1.5, seed=seed
            )
            .choices[0]
            .message.content
            for seed in range(3)
        }
        assert hot - {greedy}
    finally:
        admin.delete(f"/v1/endpoints/{endpoint_id}")
        wait_status(admin, endpoint_id, "gone")


def test_keys_scopes_and_revocation(platform: PlatformProcess, tenant: Tenant) -> None:
    inference_only = platform.api(tenant.key["key"])
    r = inference_only.post("/v1/keys", json={"name": "x"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    r = inference_only.post("/v1/models/deploy", json={"model_name": "a", "model_artifact": "a"})
    assert r.status_code == 403
    r = tenant.api.post("/v1/tenants", json={"name": "sneaky"})  # tenant admin, not platform
    assert r.status_code == 403
    listed = tenant.api.get("/v1/keys").json()["data"]
    assert {k["id"] for k in listed} >= {tenant.key["id"]}
    assert all("key" not in k and k["prefix"].startswith("sk-my-") for k in listed)
    assert tenant.api.delete(f"/v1/keys/{tenant.key['id']}").json()["revoked_at"]
    with pytest.raises(openai.AuthenticationError):
        tenant.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    for headers in ({}, {"authorization": "Bearer sk-my-nope"}, {"authorization": "Basic x"}):
        r = httpx.post(f"{platform.url}/v1/chat/completions", headers=headers, json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_requests_per_minute_limit(platform: PlatformProcess, admin: httpx.Client) -> None:
    t = Tenant(platform, admin, f"rpm-{time.time_ns()}", rpm_limit=3)
    http = platform.api(t.key["key"])
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    seen = []
    for _ in range(3):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        seen.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    assert seen == [2, 1, 0]
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError):
        t.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)


def test_tokens_per_minute_reserve_and_reconcile(
    platform: PlatformProcess, admin: httpx.Client
) -> None:
    t = Tenant(platform, admin, f"tpm-{time.time_ns()}", tpm_limit=300)
    http = platform.api(t.key["key"])
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                 "max_tokens": 400})  # fmt: skip
    assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                 "max_tokens": 100})  # fmt: skip
    assert r.status_code == 200
    used = r.json()["usage"]["total_tokens"]
    # 100 completion tokens and the prompt's bound were reserved; what was not used was given
    # back after the response.
    last = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}
    after = http.post("/v1/chat/completions", json=last)
    remaining = int(after.headers["x-ratelimit-remaining-tokens"])
    assert remaining >= 300 - used - reservation_bound("chat", last, 4096), (remaining, used)


def test_monthly_quota(platform: PlatformProcess, admin: httpx.Client) -> None:
    t = Tenant(platform, admin, f"quota-{time.time_ns()}", quota=30)
    first = t.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20)
    assert first.usage.total_tokens > 30
    with pytest.raises(openai.RateLimitError) as info:
        t.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert info.value.body["code"] == "insufficient_quota"
    r = admin.patch(f"/v1/tenants/{t.id}", json={"monthly_token_quota": 10_000})
    assert r.status_code == 200
    assert t.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)


def test_usage_is_metered_once_per_request(tenant: Tenant) -> None:
    ids = []
    for i in range(3):
        raw = tenant.client.chat.completions.with_raw_response.create(
            model="tiny", messages=MESSAGES, max_tokens=4 + i, temperature=0
        )
        ids.append(raw.headers["x-request-id"])
    stream = tenant.client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=6, stream=True
    )
    ids.append(stream.headers["x-request-id"])
    list(stream.parse())
    rows = wait_request_ids(tenant.api, ids)
    assert sorted(r["request_id"] for r in rows) == sorted(ids)
    assert [int(r["completion_tokens"]) for r in rows] == [4, 5, 6, 6]
    assert all(int(r["prompt_tokens"]) > 0 and r["status"] == "ok" for r in rows)
    assert all(r["key_id"] == tenant.key["id"] and r["model"] == "tiny" for r in rows)
    report = tenant.api.get("/v1/usage", params={"group_by": "model"}).json()
    (group,) = report["data"]
    assert group["requests"] == 4 and group["completion_tokens"] == 21
    expected = (
        (group["prompt_tokens"] - group["cached_tokens"]) * 1.0
        + group["cached_tokens"] * 1.0
        + 21 * 2.0
    )
    assert abs(group["cost_usd"] - expected / 1e6) < 1e-9
    by_key = tenant.api.get("/v1/usage", params={"group_by": "key"}).json()["data"]
    assert [g["key"] for g in by_key] == [tenant.key["id"]]
    by_day = tenant.api.get("/v1/usage", params={"group_by": "day"}).json()["data"]
    assert len(by_day) == 1 and by_day[0]["requests"] == 4


def test_a_disconnected_stream_is_billed_for_what_was_generated(
    platform: PlatformProcess, tenant: Tenant
) -> None:
    # In postgres-redis mode this is issue 10 item 2: the disconnect used to cancel the relay's
    # cleanup while it awaited the quota update in Redis, and no usage row was written.
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 400, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream(
        "POST",
        f"{platform.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {tenant.key['key']}"},
        timeout=30,
    ) as r:
        request_id = r.headers["x-request-id"]
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 6:
                break
    rows = wait_request_ids(tenant.api, [request_id], timeout=15)
    (row,) = [r for r in rows if r["request_id"] == request_id]
    assert row["status"] == "client_disconnected"
    assert 5 <= int(row["completion_tokens"]) < 400
    assert int(row["prompt_tokens"]) > 0


def test_tenants_are_isolated(
    platform: PlatformProcess, admin: httpx.Client, models_dir: Path
) -> None:
    a = Tenant(platform, admin, f"iso-a-{time.time_ns()}")
    b = Tenant(platform, admin, f"iso-b-{time.time_ns()}")
    private = deploy(a.api, "a-private", str(models_dir / "tiny"))
    a.client.chat.completions.create(model="a-private", messages=MESSAGES, max_tokens=2)
    wait_usage(a.api, bool)

    # Models and endpoints.
    assert "a-private" in [m.id for m in a.client.models.list()]
    assert "a-private" not in [m.id for m in b.client.models.list()]
    with pytest.raises(openai.NotFoundError):
        b.client.chat.completions.create(model="a-private", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        b.client.chat.completions.create(model=private, messages=MESSAGES, max_tokens=2)
    assert b.api.get(f"/v1/endpoints/{private}").status_code == 404
    assert b.api.delete(f"/v1/endpoints/{private}").status_code == 404
    assert private not in [e["endpoint_id"] for e in b.api.get("/v1/endpoints").json()["data"]]
    assert b.api.get(f"/v1/models/{private}").status_code == 404
    # Keys.
    assert a.key["id"] not in [k["id"] for k in b.api.get("/v1/keys").json()["data"]]
    assert b.api.get(f"/v1/keys/{a.key['id']}").status_code == 404
    assert b.api.delete(f"/v1/keys/{a.key['id']}").status_code == 404
    assert b.api.get("/v1/keys", params={"tenant_id": a.id}).status_code == 404
    r = b.api.post("/v1/keys", json={"name": "steal", "tenant_id": a.id})
    assert r.status_code == 403
    # Usage.
    assert usage_rows(a.api) and not usage_rows(b.api)
    assert b.api.get("/v1/usage", params={"tenant_id": a.id}).status_code == 404
    # Tenants.
    assert [t["id"] for t in b.api.get("/v1/tenants").json()["data"]] == [b.id]
    assert b.api.get(f"/v1/tenants/{a.id}").status_code == 404
    # The platform admin sees both.
    assert private in [e["endpoint_id"] for e in admin.get("/v1/endpoints").json()["data"]]
    a.api.delete(f"/v1/endpoints/{private}")


def test_tenant_admins_cannot_deploy_arbitrary_server_paths(tenant: Tenant) -> None:
    r = tenant.api.post("/v1/models/deploy", json={"model_name": "etc", "model_artifact": "/etc"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "path_not_allowed"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "tiny"}, 400, "missing_required_parameter"),
        ({"messages": MESSAGES}, 400, "missing_required_parameter"),
        ({"model": "tiny", "messages": MESSAGES, "max_tokens": "many"}, 400, "invalid_value"),
        ({"model": "tiny", "messages": "hi"}, 400, "invalid_value"),
        ({"model": "tiny", "messages": MESSAGES, "max_tokens": 10**6}, 400, "invalid_value"),
        ({"model": "nope", "messages": MESSAGES}, 404, "model_not_found"),
    ],
)
def test_bad_input_gets_openai_errors_and_is_not_metered(
    platform: PlatformProcess, tenant: Tenant, body: dict, status: int, code: str
) -> None:
    http = platform.api(tenant.key["key"])
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert_only_sentinel_metered(http, tenant)


def test_malformed_and_oversized_bodies(platform: PlatformProcess, tenant: Tenant) -> None:
    http = platform.api(tenant.key["key"])
    r = http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = http.post("/v1/chat/completions", content=b"[1, 2]")
    assert r.status_code == 400
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (9 * 2**20)}]}
    r = http.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = http.post("/v1/models/deploy", json={"model_name": "x", "model_artifact": "y",
                                             "framework": "vllm"})  # fmt: skip
    assert r.status_code == 403  # inference key: no admin scope
    r = tenant.api.post("/v1/models/deploy", json={"model_name": "x", "model_artifact": "y",
                                                   "framework": "tgi"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_framework"
    r = tenant.api.post("/v1/models/deploy", json={"model_name": "x",
                                                   "model_artifact": "gs://b/m"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_artifact"
    # s3:// is imported when its bucket is allowed (tests/store/test_s3_artifacts.py); none is here.
    r = tenant.api.post("/v1/models/deploy", json={"model_name": "x",
                                                   "model_artifact": "s3://b/m"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_artifact"
    assert_only_sentinel_metered(http, tenant)


def test_files_api_in_both_modes(platform: PlatformProcess, tenant: Tenant) -> None:
    c = tenant.client
    data = jsonl([batch_line("x")])
    created = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert created.object == "file" and created.bytes == len(data) and created.purpose == "batch"
    assert c.files.retrieve(created.id).filename == "in.jsonl"
    assert c.files.content(created.id).content == data
    assert created.id in [f.id for f in c.files.list(purpose="batch")]
    with pytest.raises(openai.BadRequestError):
        c.files.create(file=("x.jsonl", io.BytesIO(data)), purpose="fine-tune-nope")
    assert c.files.delete(created.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        c.files.content(created.id)
    assert created.id not in [f.id for f in c.files.list()]


def test_batch_runs_each_item_once_and_bills_it_once(
    platform: PlatformProcess, admin: httpx.Client, tenant: Tenant
) -> None:
    c = tenant.client
    lines: list[Any] = [batch_line(f"req-{i}", f"Question {i}", 2 + i % 3) for i in range(12)]
    lines += [b"garbage", batch_line("req-0"), batch_line("unknown-model", model="nope")]
    upload = c.files.create(file=("b.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = c.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_batch(c, batch.id, {"completed", "failed", "expired", "cancelled"})
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed) == (15, 12)
    assert done.request_counts.failed == 3
    out = read_jsonl(c, done.output_file_id)
    err = read_jsonl(c, done.error_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(12))
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert {e["error"]["code"] for e in err} >= {"model_not_found", "duplicate_custom_id"}
    rows = wait_usage(tenant.api, lambda rows: len(rows) >= 12)
    assert len(rows) == len({r["request_id"] for r in rows}) == 12
    assert all(r["batch"] == "1" and r["key_id"] == tenant.key["id"] for r in rows)
    assert sum(int(r["completion_tokens"]) for r in rows) == sum(
        o["response"]["body"]["usage"]["completion_tokens"] for o in out
    )
    assert batch.id in [b.id for b in c.batches.list(limit=5).data]
