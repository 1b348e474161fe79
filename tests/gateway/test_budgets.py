"""Budgets in dollars through a real `modelyard serve`, once per platform mode (SQLite with the
spend counters in memory; PostgreSQL with them in Redis): streams in flight when a key's budget
is crossed and the requests after them stop at the limit within one request's cost; a batch's
items stop with `budget_exceeded` once its key's budget is spent (at the batch discount); a
soft limit alerts once (webhook and audit event); spend is readable per key and model, exactly;
the management API refuses what is out of bounds and audits what it changes; a registry LoRA
adapter with prices of its own costs them (its tenant's only), else its base endpoint's."""

from __future__ import annotations

import io
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from modelyard.cli import app
from modelyard.registry_client import RegistryClient
from tests.gateway.budget_fixtures import MESSAGES, Hook, Tenant
from tests.platform_harness import (
    PlatformProcess,
    deploy,
    jsonl,
    tiny_models_env,
    wait_batch,
    wait_request_ids,
)
from tests.waiting import wait_until

# Micro-dollars per token: $100 and $200 per 1M tokens, so a row's cost is exact to check.
IN_MICRO, OUT_MICRO = 100, 200


@pytest.fixture(scope="module")
def hook() -> Iterator[Hook]:
    h = Hook()
    yield h
    h.shutdown()
    h.server_close()


@pytest.fixture(scope="module")
def platform(
    platform_env: dict[str, str],
    hook: Hook,
    tmp_path_factory: pytest.TempPathFactory,
    models_dir: Path,
    cache_dir: Path,
) -> Iterator[PlatformProcess]:
    env = {
        **platform_env,
        **tiny_models_env(models_dir),
        "MODELYARD_BATCH_POLL_INTERVAL_S": "0.2",
        "MODELYARD_BATCH_WEBHOOK_HOSTS": json.dumps([f"127.0.0.1:{hook.server_address[1]}"]),
    }
    p = PlatformProcess(tmp_path_factory.mktemp("data"), env).start()
    failed = True
    try:
        yield p
        failed = False
    finally:
        p.stop()
        if failed:
            print(p.output()[-20000:])


@pytest.fixture(scope="module")
def admin(platform: PlatformProcess) -> Iterator[httpx.Client]:
    with platform.api() as client:
        yield client


@pytest.fixture(scope="module")
def tiny(platform: PlatformProcess, admin: httpx.Client, models_dir: Path) -> str:
    """A public endpoint, priced by the platform admin (half off for batch items)."""
    endpoint_id = deploy(admin, "tiny", str(models_dir / "tiny"), public=True)
    price = {"input_usd_per_million": "100", "output_usd_per_million": 200,
             "batch_discount_percent": 50}  # fmt: skip
    r = admin.put(f"/v1/prices/{endpoint_id}", json=price)
    assert r.status_code == 200, r.text
    assert r.json()["output_usd_per_million"] == "200"
    return endpoint_id


def row_cost(row: dict[str, str], batch: bool = False) -> int:
    micro = int(row["prompt_tokens"]) * IN_MICRO + int(row["completion_tokens"]) * OUT_MICRO
    return -(-micro // 2) if batch else micro


def test_streams_and_requests_stop_at_the_budget_within_one_request(
    platform: PlatformProcess, admin: httpx.Client, tiny: str
) -> None:
    t = Tenant(platform, admin)
    limit = 50_000  # $0.05: a stream of 40 tokens costs ~$0.011 and reserves ~$0.04
    t.budget(scope="key", subject_id=t.key["id"], period="day", limit_usd="0.05")
    outcomes: list[tuple[int, str]] = []
    threads = [threading.Thread(target=lambda: outcomes.append(t.stream(40))) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    answered = [rid for status, rid in outcomes if status == 200]
    refused = [code for status, code in outcomes if status != 200]
    # The reservations of the streams in flight crossed the limit: the rest were refused.
    assert answered and refused and set(refused) == {"budget_exceeded"}, outcomes
    for _ in range(20):  # then one request after the other, until the budget is spent
        r = t.chat(40)
        if r.status_code != 200:
            break
        answered.append(r.headers["x-request-id"])
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "budget_exceeded", r.text
    rows = [x for x in wait_request_ids(t.api, answered) if x["request_id"] in answered]
    costs = [row_cost(x) for x in rows]
    assert limit <= sum(costs) < limit + max(costs), (sum(costs), costs)

    # Spend per key and per model, exact; the budget's counter holds the same.
    by_key = t.api.get("/v1/usage", params={"group_by": "key"}).json()
    (group,) = [g for g in by_key["data"] if g["key"] == t.key["id"]]
    assert group["cost_micro_usd"] == sum(costs)
    by_model = t.api.get("/v1/usage", params={"group_by": "model"}).json()
    assert [g["cost_micro_usd"] for g in by_model["data"] if g["model"] == "tiny"] == [sum(costs)]
    (budget,) = t.api.get("/v1/budgets").json()["data"]
    assert budget["spent_micro_usd"] == sum(costs), budget


def test_a_batch_stops_with_budget_exceeded(
    platform: PlatformProcess, admin: httpx.Client, tiny: str
) -> None:
    # One item at a time: each is admitted on the spend of those before it (with several in
    # flight, their reservations may refuse one while the spend is below the limit).
    t = Tenant(platform, admin, max_concurrent_batch_items=1)
    t.budget(scope="key", subject_id=t.key["id"], period="month", limit_usd=0.01)
    client = platform.openai(t.key["key"])
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "ignore_eos": True}
    lines = [{"custom_id": f"i-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": body} for i in range(10)]  # fmt: skip
    upload = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_batch(client, batch.id, {"completed", "failed"})
    counts = done.request_counts
    assert counts.completed >= 1 and counts.failed >= 1, counts
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"budget_exceeded"}, errors
    rows = wait_until(
        lambda: len(got := [r for r in _rows(t) if r["batch"] == "1"]) == counts.completed
        and got, "the items' usage rows")  # fmt: skip
    costs = [row_cost(r, batch=True) for r in rows]
    assert [round(float(r["cost_usd"]) * 1e6) for r in rows] == costs  # at the batch discount
    assert 10_000 <= sum(costs) < 10_000 + max(costs), (sum(costs), costs)


def _rows(t: Tenant) -> list[dict[str, str]]:
    import csv

    r = t.api.get("/v1/usage/export")
    assert r.status_code == 200, r.text
    return list(csv.DictReader(io.StringIO(r.text)))


def test_a_soft_limit_alerts_once(
    platform: PlatformProcess, admin: httpx.Client, tiny: str, hook: Hook
) -> None:
    t = Tenant(platform, admin)
    # A tenant's own budget is the platform admin's to set.
    body = {"scope": "tenant", "period": "month", "limit_usd": "1", "soft_limit_usd": "0.01",
            "webhook_url": hook.url}  # fmt: skip
    r = t.api.post("/v1/budgets", json=body)
    assert r.status_code == 403, r.text
    r = admin.post("/v1/budgets", json={**body, "tenant_id": t.id})
    assert r.status_code == 201, r.text
    budget_id = r.json()["id"]
    answered = []
    for _ in range(5):  # ~$0.004 each: the soft limit is crossed by the third
        r = t.chat(8)
        assert r.status_code == 200, r.text
        answered.append(r.headers["x-request-id"])
    wait_request_ids(t.api, answered)
    mine = wait_until(
        lambda: [h for h in hook.received if h[1]["data"]["budget_id"] == budget_id],
        "the soft limit's webhook",
    )
    audit = wait_until(
        lambda: t.api.get("/v1/audit", params={"action": "budget.soft_limit_crossed"})
        .json()["data"], "the soft limit's audit event")  # fmt: skip
    for _ in range(2):
        assert t.chat(8).status_code == 200
    assert len(mine) == 1 and len(audit) == 1, (mine, audit)
    headers, event = mine[0]
    assert event["type"] == "budget.soft_limit_crossed" and "webhook-signature" in headers
    assert float(event["data"]["spent_usd"]) >= 0.01
    assert audit[0]["target_id"] == budget_id


def test_the_management_api_bounds_and_audits(
    platform: PlatformProcess, admin: httpx.Client, tiny: str
) -> None:
    t = Tenant(platform, admin)
    key_id = t.key["id"]
    bad = [
        ({"scope": "key", "subject_id": key_id, "limit_usd": 1, "colour": "red"}, "colour"),
        ({"scope": "key", "subject_id": key_id, "limit_usd": "0.0000001"}, "limit_usd"),
        ({"scope": "key", "subject_id": key_id, "limit_usd": 1e12}, "limit_usd"),
        ({"scope": "key", "subject_id": key_id, "limit_usd": 1, "soft_limit_usd": 2},
         "soft_limit_usd"),
        ({"scope": "key", "subject_id": key_id, "limit_usd": 1, "period": "week"}, "period"),
        ({"scope": "key", "limit_usd": 1}, "subject_id"),
        ({"scope": "key", "subject_id": key_id, "limit_usd": True}, "limit_usd"),  # not $1
        # Only plain decimals: "5_0" is not $50 (as Python's Decimal would read it).
        *[({"scope": "key", "subject_id": key_id, "limit_usd": v}, "limit_usd")
          for v in ("5_0", " 5", "5e1", "+5", "\u0665")],
        ({"scope": "key", "subject_id": key_id, "limit_usd": 9, "soft_limit_usd": "1_0"},
         "soft_limit_usd"),
    ]  # fmt: skip
    for body, param in bad:
        r = t.api.post("/v1/budgets", json=body)
        assert r.status_code == 400, (body, r.text)
        assert param in r.text, (body, r.text)
    r = t.api.put(f"/v1/prices/{tiny}", json={"input_usd_per_million": 1})
    assert r.status_code == 404, r.text  # another tenant's endpoint: not the tenant's to price
    team = t.api.post("/v1/teams", json={"name": "team-a"})
    assert team.status_code == 201, team.text  # a team budget names a team of its tenant
    made = t.budget(scope="team", subject_id=team.json()["id"], period="day", limit_usd=2)
    # Another tenant's admin finds it as it finds an id nobody has: the same 404.
    other = Tenant(platform, admin)
    for budget_id in (made["id"], "bdg-0000000000000000"):
        for method in ("GET", "PATCH", "DELETE"):
            body = {"limit_usd": 100} if method == "PATCH" else None
            r = other.api.request(method, f"/v1/budgets/{budget_id}", json=body)
            assert r.status_code == 404, r.text
            assert r.json()["error"]["message"] == f"No budget {budget_id!r}.", r.text
    r = t.api.patch(f"/v1/budgets/{made['id']}", json={"limit_usd": "3.5"})
    assert r.status_code == 200 and r.json()["limit_usd"] == "3.5", r.text
    assert t.api.delete(f"/v1/budgets/{made['id']}").status_code == 200
    actions = [e["action"] for e in t.api.get("/v1/audit").json()["data"]]
    assert {"budget.create", "budget.update", "budget.delete"} <= set(actions), actions

    # The CLI: a budget made and listed with its spend, the usage by key with its cost.
    env = {"MODELYARD_URL": platform.url, "MODELYARD_API_KEY": t.admin_key}

    def cli(*args: str) -> Any:
        result = CliRunner().invoke(app, [*args, "--json"], env=env)
        assert result.exit_code == 0, (result.output, result.exception)
        return json.loads(result.stdout)

    refused = CliRunner().invoke(
        app, ["budgets", "create", "key", "--subject", key_id, "--limit", "5_0"], env=env
    )
    assert refused.exit_code == 1 and "limit_usd" in refused.output, refused.output
    made = cli("budgets", "create", "key", "--subject", key_id, "--limit", "0.5", "--period", "day")
    assert made["limit_micro_usd"] == 500_000
    assert t.chat(4).status_code == 200
    (listed,) = cli("budgets", "list")
    assert listed["id"] == made["id"] and listed["spent_micro_usd"] > 0, listed
    usage = cli("usage", "--group-by", "key")
    assert [g["cost_micro_usd"] for g in usage["data"]] == [listed["spent_micro_usd"]], usage


# An adapter's own prices: $300 and $700 per 1M tokens, 10 % off batch items.
AD_IN, AD_OUT = 300, 700


def _cost(row: dict[str, str], inp: int, out: int) -> int:
    return int(row["prompt_tokens"]) * inp + int(row["completion_tokens"]) * out


def test_an_adapter_costs_its_own_price_else_its_base_endpoints(
    platform: PlatformProcess, admin: httpx.Client, models_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("peft")
    from tests.engine.test_lora import make_adapter

    t, other = Tenant(platform, admin), Tenant(platform, admin)
    ns = uuid.uuid4().hex[:8]
    base, served = f"abase-{ns}", f"aserve-{ns}"
    adapter = make_adapter(models_dir / "tiny", tmp_path / "bot", 1, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj"])  # fmt: skip
    slots = {"max_loras": 1, "max_lora_rank": 8}
    base_price = {"input_usd_per_million": 100, "output_usd_per_million": "200"}
    RegistryClient(platform.url, t.admin_key).push(models_dir / "tiny", base)
    RegistryClient(platform.url, t.admin_key).push(adapter, "bot", base=base)
    endpoint = deploy(t.api, served, base, engine=slots)  # the tenant's own base
    assert t.api.put(f"/v1/prices/{endpoint}", json=base_price).status_code == 200
    # The other tenant's adapter of the same name, on a public base at the same price.
    RegistryClient(platform.url, platform.admin_key).push(models_dir / "tiny", f"p{base}")
    public = deploy(admin, f"p{served}", f"p{base}", public=True, engine=slots)
    assert admin.put(f"/v1/prices/{public}", json=base_price).status_code == 200
    RegistryClient(platform.url, other.admin_key).push(adapter, "bot", base=f"p{served}")
    assert t.api.get("/v1/prices/adapters/bot").json()["priced"] is False
    price = {"input_usd_per_million": "300", "output_usd_per_million": 700,
             "batch_discount_percent": "10"}  # fmt: skip
    r = other.api.put("/v1/prices/adapters/bot", params={"tenant_id": t.id}, json=price)
    assert r.status_code == 404, r.text  # not the other tenant's to price
    for bad in ({**price, "input_usd_per_million": "1000.000001"},
                {**price, "batch_discount_percent": "10.001"}, {**price, "colour": 1},
                {**price, "input_usd_per_million": "3_00"},
                {**price, "output_usd_per_million": "7e2"},
                {**price, "batch_discount_percent": "1_0"}):  # fmt: skip
        r = t.api.put("/v1/prices/adapters/bot", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] in bad, (bad, r.text)
    assert t.api.put(f"/v1/prices/adapters/{base}", json=price).status_code == 404  # no adapter
    r = t.api.put("/v1/prices/adapters/bot", json=price)
    assert r.status_code == 200, r.text
    mine = r.json()
    assert (mine["priced"], mine["output_usd_per_million"], mine["tenant_id"]) == (
        True,
        "700",
        t.id,
    )
    assert admin.get("/v1/prices/adapters/bot", params={"tenant_id": t.id}).json() == mine
    theirs = other.api.get("/v1/prices/adapters/bot").json()  # its own adapter: unpriced
    assert theirs["priced"] is False and theirs["model_id"] != mine["model_id"], theirs
    assert other.api.get("/v1/prices/adapters/bot", params={"tenant_id": t.id}).status_code == 404
    (audit,) = t.api.get("/v1/audit", params={"action": "adapter_price.set"}).json()["data"]
    assert (
        audit["target_id"] == mine["model_id"] and audit["after"]["input_usd_per_million"] == "300"
    )

    ids = {m: t.chat(4, model=m) for m in ("bot", "bot:1", served)}
    theirs_id = other.chat(4, model="bot")
    assert theirs_id.status_code == 200 and all(x.status_code == 200 for x in ids.values()), ids
    sent = [x.headers["x-request-id"] for x in ids.values()]
    rows = {x["request_id"]: x for x in wait_request_ids(t.api, sent)}
    for model, answer in ids.items():
        row = rows[answer.headers["x-request-id"]]
        want = _cost(row, IN_MICRO, OUT_MICRO) if model == served else _cost(row, AD_IN, AD_OUT)
        assert row["adapter"] == ("" if model == served else "bot:1"), row
        assert round(float(row["cost_usd"]) * 1e6) == want, (model, row)
    # The other tenant's `bot` costs the base endpoint's price: never the first tenant's.
    (row,) = [x for x in wait_request_ids(other.api, [theirs_id.headers["x-request-id"]])]
    assert row["adapter"] == "bot:1" and round(float(row["cost_usd"]) * 1e6) == _cost(
        row, IN_MICRO, OUT_MICRO
    ), row

    # A batch item naming the adapter: its price, 10 % off.
    client = platform.openai(t.key["key"])
    body = {"model": "bot", "messages": MESSAGES, "max_tokens": 4, "ignore_eos": True}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    upload = client.files.create(file=("a.jsonl", io.BytesIO(jsonl([line]))), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert wait_batch(client, batch.id, {"completed", "failed"}).status == "completed"
    (item,) = wait_until(lambda: [x for x in _rows(t) if x["batch"] == "1"], "the item's row")
    full = _cost(item, AD_IN, AD_OUT)
    assert item["adapter"] == "bot:1" and round(float(item["cost_usd"]) * 1e6) == -(
        -full * 9 // 10
    ), item

    # A budget spent through the adapter: refused at its limit, its spend what the rows cost.
    t.budget(scope="key", subject_id=t.key["id"], period="day", limit_usd="0.05")
    answered = list(sent)
    for _ in range(30):
        r = t.chat(8, model="bot")
        if r.status_code != 200:
            break
        answered.append(r.headers["x-request-id"])
    assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded", r.text
    rows = {x["request_id"]: x for x in wait_request_ids(t.api, answered)}
    spent = sum(
        round(float(x["cost_usd"]) * 1e6) for x in rows.values() if x["key_id"] == t.key["id"]
    )
    (budget,) = t.api.get("/v1/budgets").json()["data"]
    assert budget["spent_micro_usd"] == spent, (budget, spent)
    last = _cost(rows[answered[-1]], AD_IN, AD_OUT)
    assert 50_000 <= spent < 50_000 + last, (spent, last)
    # Its price shown and removed from the CLI: the base endpoint's applies again.
    env = {"MODELYARD_URL": platform.url, "MODELYARD_API_KEY": t.admin_key}
    for command, priced in (("show", True), ("clear", False)):
        result = CliRunner().invoke(app, ["prices", "adapter", command, "bot", "--json"], env=env)
        assert result.exit_code == 0, (result.output, result.exception)
        assert json.loads(result.stdout)["priced"] is priced, result.stdout
    assert t.api.get("/v1/prices/adapters/bot").json()["priced"] is False
