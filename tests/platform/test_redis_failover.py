"""Redis without a single point of failure, through a real `modelyard serve`, real Redis
processes (never the machine's shared one) and the `openai` SDK as users run it:

- Sentinel: serve on PostgreSQL with `MODELYARD_REDIS_URL=redis+sentinel://…` under steady chat
  load (streamed and not, the SDK's default retries); the Redis primary SIGKILLed; once the
  Sentinels have promoted the replica, admission and settlement go on: every request succeeds
  (the SDK retried the 503s `limits_unavailable` of the failover window), every answer has exactly
  one usage row, and the quota counters were rebuilt on the new primary.
- Quota counters that survive Redis: a tenant at its monthly quota stays refused (429
  `insufficient_quota`) after Redis restarts empty (postgres-redis) or serve restarts
  (sqlite-memory, counters in memory). Before, Redis's restart handed the tenant its month back.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from tests.chaos_harness import Outcome, RedisServer, check_usage
from tests.databases import PLATFORM_MODES, fresh_postgres
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    tiny_models_env,
    usage_rows,
    wait_request_ids,
    wait_usage,
)
from tests.redis_sentinel import SentinelRedis, printed_on_failure
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "Tell me a story about a fox"}]


@dataclass
class Load:
    """Steady chat load from `workers` threads, each an `openai` client with the SDK's default
    retries; every attempt's status and time is seen on the wire (an httpx hook)."""

    url: str
    key: str
    workers: int = 3
    answers: list[Outcome] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    attempts: list[tuple[float, int]] = field(default_factory=list)  # (time, status)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def _seen(self, response: httpx.Response) -> None:
        with self._lock:
            self.attempts.append((time.monotonic(), response.status_code))

    def _run(self, worker: int) -> None:
        http = httpx.Client(event_hooks={"response": [self._seen]}, timeout=60)
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, http_client=http)
        n = 0
        while not self._stop.is_set():
            stream = (n + worker) % 2 == 0
            n += 1
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="tiny",
                    messages=MESSAGES,
                    max_tokens=8,
                    stream=stream,  # type: ignore[arg-type]
                )
                request_id = raw.headers.get("x-request-id")
                body = raw.parse()
                if stream:
                    chunks = list(body)  # type: ignore[arg-type]
                    assert chunks, "an empty stream"
                with self._lock:
                    self.answers.append(Outcome(request_id, 200, True, stream))
            except Exception as exc:  # what the SDK raised after its retries
                with self._lock:
                    self.failures.append(repr(exc)[:300])
        http.close()

    def count(self) -> int:
        with self._lock:
            return len(self.answers) + len(self.failures)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def test_a_sentinel_failover_under_load(tmp_path: Path, models_dir: Path, cache_dir: Path) -> None:
    with SentinelRedis(sentinels=3) as redis_set, fresh_postgres() as database_url:
        env = {
            **tiny_models_env(models_dir),
            "MODELYARD_DATABASE_URL": database_url,
            "MODELYARD_REDIS_URL": redis_set.url,
        }
        p = PlatformProcess(tmp_path / "data", env).start()
        with printed_on_failure(redis_set.logs, p.output):
            try:
                failover_under_load(p, redis_set, models_dir)
            finally:
                p.stop()


def failover_under_load(p: PlatformProcess, redis_set: SentinelRedis, models_dir: Path) -> None:
    admin = p.api()
    deploy(admin, "tiny", str(models_dir / "tiny"), public=True)
    tenant = create_tenant(admin, f"sentinel-{time.time_ns()}", quota=10**9)
    # Limits on the key and a quota: every request's admission and settlement go through Redis.
    key = create_key(admin, tenant, rpm_limit=100_000, tpm_limit=10**8)["key"]
    load = Load(p.url, key)
    try:
        wait_until(lambda: load.count() >= 6, "answers before the failover", timeout=60)
        killed = time.monotonic()
        redis_set.kill_primary()
        redis_set.wait_promoted()
        promoted = time.monotonic()
        after = load.count()
        wait_until(lambda: load.count() >= after + 12, "answers after the failover", timeout=90)
    finally:
        load.stop()
    refused = [t - killed for t, s in load.attempts if s != 200]
    answered = [t - killed for t, s in load.attempts if s == 200]
    last = max(refused, default=0.0)
    print(
        f"sentinel failover: replica promoted {promoted - killed:.2f} s after the kill; "
        f"{len(load.answers)} requests answered, {len(load.failures)} failed; "
        f"{len(refused)} attempts refused (then retried by the SDK), "
        f"from +{min(refused, default=0):.2f} s to +{max(refused, default=0):.2f} s; "
        f"first answer after them: +{min((t for t in answered if t > last), default=-1):.2f} s"
    )
    # Every request succeeded, with the SDK's own retries of the failover window's 503s.
    assert load.failures == [], load.failures[:5]
    assert {s for _, s in load.attempts if s != 200} <= {503}, load.attempts
    # Settlement went on: every answer has exactly one usage row, none without an answer.
    rows = wait_request_ids(admin, [o.request_id for o in load.answers], tenant_id=tenant)
    check_usage(load.answers, rows)
    assert len(rows) == len(load.answers)
    # The new primary's quota counters were rebuilt from the usage rows, not started empty.
    assert "quota counters rebuilt from the usage rows" in p.output()
    p.assert_no_loop_stalls()


@dataclass
class Restartable:
    """A serve process on a store whose quota counters a restart can lose: a private Redis in
    postgres-redis mode, serve's own memory in sqlite-memory mode."""

    mode: str
    data_dir: Path
    env: dict[str, str]
    redis: RedisServer | None
    p: PlatformProcess | None = None

    def start(self) -> PlatformProcess:
        self.p = PlatformProcess(self.data_dir, self.env).start()
        return self.p

    def lose_the_counters(self) -> None:
        """Restart what holds them: Redis (empty, no persistence), or serve."""
        assert self.p is not None
        if self.redis is not None:
            self.redis.kill()
            self.redis.start()
        else:
            self.p.stop()
            self.start()

    def logs(self) -> str:
        return self.p.output() if self.p is not None else ""


@pytest.fixture(params=PLATFORM_MODES)
def restartable(
    request: pytest.FixtureRequest, tmp_path: Path, models_dir: Path, cache_dir: Path
) -> Iterator[Restartable]:
    env = tiny_models_env(models_dir)
    with contextlib.ExitStack() as stack:
        server = None
        if request.param == "postgres-redis":
            database_url = stack.enter_context(fresh_postgres())
            server = RedisServer()
            stack.callback(server.close)
            server.start()
            env = {**env, "MODELYARD_DATABASE_URL": database_url,
                   "MODELYARD_REDIS_URL": server.url}  # fmt: skip
        r = Restartable(request.param, tmp_path / "data", env, server)
        try:
            yield r
        finally:
            if r.p is not None:
                r.p.stop()


def test_a_tenant_at_its_quota_stays_refused_after_its_counters_are_lost(
    restartable: Restartable, models_dir: Path
) -> None:
    p = restartable.start()
    with printed_on_failure(restartable.logs):
        admin = p.api()
        deploy(admin, "tiny", str(models_dir / "tiny"), public=True)
        tenant = create_tenant(admin, f"quota-{time.time_ns()}", quota=1_500)
        key = create_key(admin, tenant)["key"]
        used = use_up(p, key)
        rows = wait_usage(admin, lambda r: sum(_tokens(x) for x in r) == used, tenant_id=tenant)
        assert sum(_tokens(r) for r in rows) >= 1_500
        restartable.lose_the_counters()
        p = restartable.p
        assert p is not None
        admin = p.api()  # serve's port changes with a restart
        # Before: Redis came back empty and the tenant got its 1,500 tokens back.
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8}
        r = httpx.post(f"{p.url}/v1/chat/completions", json=body, timeout=60,
                       headers={"authorization": f"Bearer {key}"})  # fmt: skip
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "insufficient_quota", r.text
        assert len(usage_rows(admin, tenant_id=tenant)) == len(rows)
        p.assert_no_loop_stalls()


def use_up(p: PlatformProcess, key: str) -> int:
    """Requests until the quota refuses one; the tokens the answered ones used."""
    client = p.openai(key)
    used = 0
    for _ in range(40):
        try:
            answer = client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=200,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        except openai.RateLimitError as exc:
            assert exc.code == "insufficient_quota", exc
            return used
        assert answer.usage is not None
        used += answer.usage.total_tokens
    raise AssertionError(f"40 requests ({used} tokens) never met the quota")


def _tokens(row: dict[str, str]) -> int:
    return int(row["prompt_tokens"]) + int(row["completion_tokens"])
