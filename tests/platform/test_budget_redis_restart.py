"""A budget in dollars across a Redis restart, through a real `modelyard serve` (PostgreSQL and a
private `redis-server` without persistence, which this test kills and starts again empty while
the platform runs): a key that spent its budget stays refused with 429 `budget_exceeded`
(before, its counter started again from 0 and it was served up to another budget), the budget
API reads the same spend as before the restart (what its usage rows cost), and the gateway
rebuilt the spend counters once (`modelyard_gateway_counters_rebuilt_total`). The mechanism,
and what a settlement across the loss does: `tests/gateway/test_spend_rebuild.py`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos_harness import RedisServer
from tests.databases import fresh_postgres
from tests.gateway.budget_fixtures import Tenant
from tests.platform_harness import PlatformProcess, deploy, tiny_models_env, wait_request_ids

pytestmark = pytest.mark.timeout(300)

SERIES = 'modelyard_gateway_counters_rebuilt_total{counters="spend"}'


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer.running() as server:  # no persistence: a restart comes back empty
        yield server


@pytest.fixture
def platform(
    redis_server: RedisServer, models_dir: Path, tmp_path: Path
) -> Iterator[PlatformProcess]:
    with fresh_postgres() as database_url:
        env = {"MODELYARD_DATABASE_URL": database_url, "MODELYARD_REDIS_URL": redis_server.url,
               **tiny_models_env(models_dir)}  # fmt: skip
        p = PlatformProcess(tmp_path / "data", env)
        try:
            p.start()
            yield p
        except BaseException:
            print(f"===== serve\n{p.output()[-12000:]}")
            raise
        finally:
            p.stop()


def spend_rebuilds(p: PlatformProcess) -> float:
    """The gateway's rebuilds of the spend counters so far, from its /metrics."""
    for line in p.api().get("/metrics").text.splitlines():
        if line.startswith(SERIES + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{SERIES} is not exposed")


def test_a_spent_budget_stays_refused_after_redis_restarts_empty(
    platform: PlatformProcess, redis_server: RedisServer, models_dir: Path
) -> None:
    admin = platform.api()
    endpoint_id = deploy(admin, "tiny", str(models_dir / "tiny"), public=True)
    price = {"input_usd_per_million": "100", "output_usd_per_million": "200"}
    assert admin.put(f"/v1/prices/{endpoint_id}", json=price).status_code == 200
    t = Tenant(platform, admin)
    # $0.05: a request of 40 tokens costs ~$0.01 and reserves ~$0.013.
    budget = t.budget(scope="key", subject_id=t.key["id"], period="month", limit_usd="0.05")
    answered: list[str] = []
    for _ in range(20):  # one request after the other, until the budget is spent
        r = t.chat(40)
        if r.status_code != 200:
            break
        answered.append(r.headers["x-request-id"])
    assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded", r.text
    wait_request_ids(t.api, answered)
    by_key = t.api.get("/v1/usage", params={"group_by": "key"}).json()
    (group,) = [g for g in by_key["data"] if g["key"] == t.key["id"]]
    spent = group["cost_micro_usd"]
    assert spent >= 50_000
    assert t.api.get(f"/v1/budgets/{budget['id']}").json()["spent_micro_usd"] == spent
    rebuilds = spend_rebuilds(platform)  # 1: at start, on a Redis that held no marker

    redis_server.kill()
    redis_server.start()  # empty: every counter and marker gone, the platform still running

    r = t.chat(40)
    assert r.status_code == 429, r.text  # not served against a counter back at $0
    assert r.json()["error"]["code"] == "budget_exceeded", r.text
    view = t.api.get(f"/v1/budgets/{budget['id']}").json()
    assert view["spent_micro_usd"] == spent, view  # what the usage rows cost, not 0
    assert spend_rebuilds(platform) == rebuilds + 1
    by_key = t.api.get("/v1/usage", params={"group_by": "key"}).json()
    assert [g["cost_micro_usd"] for g in by_key["data"] if g["key"] == t.key["id"]] == [spent]
