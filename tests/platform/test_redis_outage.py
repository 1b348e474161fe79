"""A Redis outage through a real `modelyard serve` (PostgreSQL + a private `redis-server` this
test kills), with the `openai` SDK as the client, in each `redis_outage` mode:

- `fail_open`: requests keep succeeding while no Redis answers, admitted on this gateway's share
  of each limit (the limit / the live gateways: here 2, a second gateway's heartbeat written
  into Redis by the test), so a key's RPM limit still bites; a stream admitted before the kill
  and settled during the outage, and every request admitted during it, is journaled and
  applied to Redis once it is back: the tenant's quota counter then equals the sum of its usage
  rows, one row per answer, with no slot left held and no journal entry left.
- in a cluster (a controller and two gateways, counted by their heartbeats): the gateways
  together admit no more than a key's RPM limit during the outage, each its third.
- `fail_closed`: a 503 `limits_unavailable` with Retry-After while Redis is away; served again
  once it is back.

The Redis keeps its data across the kill (append-only file, fsync always), as a production
Redis with persistence does: what comes back is the same data set, so the outage's settlements
are added to it (a Redis that comes back empty is rebuilt from the usage rows instead).
The limits are Redis-only by nature, so there is no sqlite-memory variant."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from sqlalchemy import create_engine, text

from modelyard.gateway.limits_outage import GATEWAYS_KEY
from modelyard.gateway.quota import month_of
from modelyard.store.repository import now
from tests.chaos_harness import RedisServer, send
from tests.cluster_harness import RoleProcess, kill_workers, wait_leader
from tests.databases import fresh_postgres
from tests.loop_stalls import assert_no_loop_stalls
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    tiny_models_env,
    usage_rows,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "Hello there"}]


class PersistentRedis(RedisServer):
    """A private `redis-server` whose data survives a SIGKILL (AOF, fsync on every write)."""

    @property
    def logfile(self) -> Path:
        return self.dir / "redis.log"

    def start(self) -> None:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.dir),
               "--logfile", str(self.logfile)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        try:
            wait_until(lambda: _pings(client), "the private redis-server to answer", 20)
        finally:
            client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture
def redis_server() -> Iterator[PersistentRedis]:
    server = PersistentRedis()
    server.start()
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def serve(
    mode: str, redis_server: PersistentRedis, models_dir: Path, data_dir: Path
) -> Iterator[PlatformProcess]:
    """`modelyard serve` on a fresh PostgreSQL database and the private Redis, in `mode`, with
    the public endpoint `tiny`; its log and Redis's printed if the test fails."""
    with fresh_postgres() as database_url:
        env = {
            "MODELYARD_DATABASE_URL": database_url,
            "MODELYARD_REDIS_URL": redis_server.url,
            "MODELYARD_REDIS_OUTAGE": mode,
            **tiny_models_env(models_dir),
        }
        p = PlatformProcess(data_dir, env)
        try:
            p.start()
            deploy(p.api(), "tiny", str(models_dir / "tiny"), public=True)
            yield p
            p.assert_no_loop_stalls()
        except BaseException:
            print(f"===== serve ({mode})\n{p.output()[-12000:]}")
            if redis_server.logfile.exists():
                print(f"===== redis-server\n{redis_server.logfile.read_text()[-4000:]}")
            raise
        finally:
            p.stop()


def metric(p: PlatformProcess, name: str) -> float:
    """A series without labels from the platform's /metrics (0 when absent)."""
    return gauge(p.api().get("/metrics").text, name)


def chat(client: openai.OpenAI, stream: bool = False) -> str:
    """One answered chat request through the SDK; its request id."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=5,
        stream=stream,  # type: ignore[arg-type]
    )
    parsed = raw.parse()
    if stream:
        chunks = list(parsed)  # type: ignore[arg-type]
        assert chunks, "an empty stream"
    else:
        assert parsed.choices  # type: ignore[union-attr]
    return str(raw.headers["x-request-id"])


def tenant_with_keys(p: PlatformProcess, **key_limits: int) -> tuple[str, str]:
    admin = p.api()
    r = admin.post(
        "/v1/tenants",
        json={"name": f"outage-{time.time_ns()}", "monthly_token_quota": 10**9,
              "max_concurrent_requests": 8},
    )  # fmt: skip
    assert r.status_code == 201, r.text
    tenant = str(r.json()["id"])
    return tenant, create_key(admin, tenant, **key_limits)["key"]


def test_fail_closed_answers_503_while_redis_is_away(
    redis_server: PersistentRedis, models_dir: Path, tmp_path: Path
) -> None:
    with serve("fail_closed", redis_server, models_dir, tmp_path / "data") as p:
        _, key = tenant_with_keys(p, rpm_limit=1000)
        client = p.openai(key)
        chat(client)
        redis_server.kill()
        with pytest.raises(openai.APIStatusError) as info:
            chat(client)
        assert info.value.status_code == 503, info.value
        assert info.value.code == "limits_unavailable"
        assert info.value.response.headers.get("retry-after")
        redis_server.start()
        back = time.monotonic()

        def served() -> bool:
            try:
                chat(client)
            except openai.APIStatusError as exc:
                assert exc.status_code == 503, exc
                return False
            return True

        wait_until(served, "a request served once Redis is back", 30, interval=0.2)
        print(f"fail_closed: served again {time.monotonic() - back:.2f} s after Redis was back")


def test_fail_open_serves_on_local_shares_and_reconciles_once(
    redis_server: PersistentRedis, models_dir: Path, tmp_path: Path
) -> None:
    with serve("fail_open", redis_server, models_dir, tmp_path / "data") as p:
        tenant, key = tenant_with_keys(p, rpm_limit=100_000, tpm_limit=10**8)
        admin = p.api()
        small_key = create_key(admin, tenant, rpm_limit=4)["key"]
        client, small = p.openai(key), p.openai(small_key)
        r = redis_server.client()
        month = month_of(now())
        counter_key = f"modelyard:quota:{tenant}:{month}"
        # A second gateway's heartbeat (it stays live for the test): every share is half.
        r.zadd(GATEWAYS_KEY, {"another-gateway": time.time() + 3600})
        wait_until(lambda: metric(p, "modelyard_gateway_limits_gateways") == 2, "N = 2", 30)

        answered = [chat(client), chat(client, stream=True)]
        before_outage = int(r.get(counter_key) or 0)
        assert before_outage > 0
        # Redis dies while a stream admitted through it is mid-answer; it settles in the outage.
        mid = send(p.url, key, "tiny", stream=True, max_tokens=20, on_first_data=redis_server.kill)
        assert mid.complete and mid.request_id, mid
        answered.append(mid.request_id)

        # No Redis at all: every request is still served, admitted on this gateway's shares.
        started = time.monotonic()
        for i in range(6):
            answered.append(chat(client, stream=i % 2 == 1))
        during = (time.monotonic() - started) / 6
        assert metric(p, "modelyard_gateway_limits_degraded") == 1
        assert metric(p, "modelyard_gateway_local_admissions_total") >= 6
        # The small key's RPM limit (4) bites at this gateway's share of it: 4 // 2 gateways.
        answered += [chat(small), chat(small)]
        with pytest.raises(openai.RateLimitError) as info:
            chat(small)
        assert info.value.code == "rate_limit_exceeded"
        assert info.value.response.headers["x-ratelimit-limit-requests"] == "2"

        redis_server.start()  # the same data set, from its append-only file
        back = time.monotonic()
        wait_until(
            lambda: metric(p, "modelyard_gateway_limits_degraded") == 0, "admission via Redis", 30
        )
        recovered = time.monotonic() - back
        answered.append(chat(client))  # admitted through Redis again

        def billed_and_counted() -> tuple[int, int] | None:
            rows = usage_rows(admin, tenant_id=tenant)
            total = sum(int(x["prompt_tokens"]) + int(x["completion_tokens"]) for x in rows)
            counted = int(r.get(counter_key) or 0)
            ids = [x["request_id"] for x in rows]
            assert len(ids) == len(set(ids)), "a request was billed twice"
            if set(ids) != set(answered) or counted != total:
                return None
            return counted, total

        counted, total = wait_until(
            billed_and_counted, "quota counter == the tenant's usage rows", 30, interval=0.2
        )
        assert counted > before_outage
        print(
            f"fail_open: 8 of 8 requests admitted in the outage served ({during:.3f} s each), "
            f"the 9th refused by the RPM share; admission via Redis {recovered:.2f} s after it "
            f"was back; quota counter {counted} == usage rows {total}"
        )
        # Nothing left over: no slot held in Redis, no journal entry waiting.
        assert r.zcard(f"modelyard:slots:{tenant}:requests") == 0
        engine = create_engine(p.env["MODELYARD_DATABASE_URL"])
        try:
            with engine.connect() as conn:
                left = conn.execute(text("SELECT count(*) FROM limits_journal")).scalar()
        finally:
            engine.dispose()
        assert left == 0
        # Applied once: later heartbeats (each looks at the journal) add nothing more.
        time.sleep(1.5)  # three heartbeats pass (the absence of a change watched a while)
        assert int(r.get(counter_key) or 0) == total
        r.close()


def test_two_gateways_each_admit_their_share_while_redis_is_away(
    redis_server: PersistentRedis, models_dir: Path, tmp_path: Path
) -> None:
    """A cluster (a controller and two `modelyard gateway`s, each counted by its heartbeat):
    in the outage a key's RPM limit is split between the live processes, so the gateways
    together admit no more than it; afterwards the quota counter equals the usage rows."""
    with fresh_postgres() as database_url:
        env = {
            **tiny_models_env(models_dir),
            "MODELYARD_DATABASE_URL": database_url,
            "MODELYARD_REDIS_URL": redis_server.url,
            "MODELYARD_DEFAULT_MODELS": "false",
            "MODELYARD_ROUTING_REFRESH_S": "1",
        }
        controller = RoleProcess("controller", tmp_path / "control", env)
        gateways = [RoleProcess("gateway", tmp_path / f"gw{i}", env) for i in (1, 2)]
        roles = [controller, *gateways]
        try:
            for role in roles:
                role.launch()
            for role in roles:
                role.wait_up()
            wait_leader(redis_server.url, [controller])
            admin_key = (tmp_path / "control" / "admin_key").read_text().strip()
            admins = [
                httpx.Client(
                    base_url=g.url, headers={"authorization": f"Bearer {admin_key}"}, timeout=60
                )
                for g in gateways
            ]
            deploy(admins[0], "tiny", str(models_dir / "tiny"), public=True)
            tenant = create_tenant(admins[0], f"split-{time.time_ns()}", quota=10**9)
            key = create_key(admins[0], tenant, rpm_limit=6)["key"]
            for admin in admins:  # both gateways route it (the admin's key has no limits)
                wait_until(lambda a=admin: chat_status(a) == 200, "the route on a gateway", 60)

            def live(admin: httpx.Client) -> float:
                return gauge(admin.get("/metrics").text, "modelyard_gateway_limits_gateways")

            for admin in admins:  # the controller and both gateways heartbeat
                wait_until(lambda a=admin: live(a) == 3, "three live processes counted", 30)
            redis_server.kill()
            admitted = []
            answered: list[str] = []
            for g in gateways:
                client = openai.OpenAI(base_url=f"{g.url}/v1", api_key=key, max_retries=0)
                ok = 0
                with pytest.raises(openai.RateLimitError):
                    for _ in range(6):
                        answered.append(chat(client))
                        ok += 1
                admitted.append(ok)
            # 6 // 3 each: the gateways together stay within the key's limit.
            assert admitted == [2, 2]
            redis_server.start()
            degraded = "modelyard_gateway_limits_degraded"
            for admin in admins:
                wait_until(
                    lambda a=admin: gauge(a.get("/metrics").text, degraded) == 0,
                    "admission via Redis",
                    30,
                )
            r = redis_server.client()
            counter_key = f"modelyard:quota:{tenant}:{month_of(now())}"
            engine = create_engine(database_url)

            def reconciled() -> bool:
                with engine.connect() as conn:
                    ids, total = conn.execute(
                        text(
                            "SELECT array_agg(request_id), "
                            "sum(prompt_tokens + completion_tokens) "
                            "FROM usage_records WHERE tenant_id = :t"
                        ),
                        {"t": tenant},
                    ).one()
                return (
                    sorted(ids or []) == sorted(answered) and int(r.get(counter_key) or 0) == total
                )

            try:
                wait_until(reconciled, "quota counter == the usage rows of both gateways", 30)
            finally:
                engine.dispose()
                r.close()
            assert_no_loop_stalls(*roles)
        except BaseException:
            for role in roles:
                print(f"===== {role.role} {role.url}\n{role.output()[-6000:]}")
            raise
        finally:
            for role in roles:
                role.kill(signal.SIGTERM)
            kill_workers(str(models_dir))


def chat_status(api: httpx.Client) -> int:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    return api.post("/v1/chat/completions", json=body).status_code


def gauge(exposition: str, name: str) -> float:
    for line in exposition.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
