"""PostgreSQL failover under load, with real processes: `modelyard serve` on a multi-host URL
(`postgresql://…@primary,standby/db?target_session_attrs=read-write`) over a private primary
and its synchronous streaming standby (`tests/pg_standby.py`), clients on the `openai` SDK with
its default retries sending chat requests throughout; the primary is killed (`pg_ctl stop -m
immediate`) and the standby promoted (`pg_ctl promote`).

Asserted: every client request is answered (after the SDK's own retries); writes resume on the
new primary without restarting anything (a new key, a new deploy that becomes ready); every
answered request id has exactly one usage row on the new primary; every usage row the old
primary had committed before its death is on the new one (synchronous replication: none of
the acknowledged rows is lost); no event loop stalled. The failover's cost (the time from the
kill until a write succeeds again, the slowest request) is printed for docs/cluster.md.

On the code before multi-host URLs this cannot run at all: SQLAlchemy cannot parse libpq's
host list (`invalid literal for int() with base 10: '…,127.0.0.1'`), so serve exits at start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psycopg
import pytest

from tests.databases import fresh_redis
from tests.pg_standby import StandbyPair, missing_binaries
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    tiny_models_env,
    wait_status,
)
from tests.waiting import wait_until

# A pair of PostgreSQL clusters, serve, two replicas and steady load on 2 vCPU.
pytestmark = pytest.mark.timeout(420)

MESSAGES = [{"role": "user", "content": "Tell me a story about a fox"}]


@pytest.fixture(scope="module")
def pair() -> Iterator[StandbyPair]:
    reason = missing_binaries()
    if reason:
        pytest.skip(reason)
    p = StandbyPair(synchronous=True)
    try:
        yield p.start()
    finally:
        print(p.logs())  # shown when the test failed
        p.close()


@pytest.fixture(scope="module")
def platform(
    pair: StandbyPair, tmp_path_factory: pytest.TempPathFactory, models_dir: Path, cache_dir: Path
) -> Iterator[PlatformProcess]:
    with fresh_redis() as redis_url:
        env = {
            **tiny_models_env(models_dir),
            "MODELYARD_DATABASE_URL": pair.url,
            "MODELYARD_REDIS_URL": redis_url,
            # Keys are looked up again during the failover, not only served from the cache.
            "MODELYARD_AUTH_CACHE_TTL_S": "0.5",
        }
        p = PlatformProcess(tmp_path_factory.mktemp("data"), env)
        try:
            yield p.start()
        finally:
            p.stop()
            print(f"----- serve -----\n{p.output()}")  # shown when the test failed


@dataclass
class Load:
    """Clients on the `openai` SDK (its default retries) sending chat requests until stopped,
    half of them streamed; each answered request's id and when it was sent."""

    url: str
    key: str
    answered: list[tuple[float, str]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    slowest_s: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, clients: int = 3) -> Load:
        for i in range(clients):
            t = threading.Thread(target=self._client, args=(i % 2 == 0,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _client(self, stream: bool) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, timeout=60)
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                request_id = self._one(client, stream)
            except Exception as exc:  # any failure is the test's to report, not a dead thread
                with self._lock:
                    self.failed.append(repr(exc)[:300])
                continue
            with self._lock:
                self.answered.append((sent, request_id))
                self.slowest_s = max(self.slowest_s, time.monotonic() - sent)

    @staticmethod
    def _one(client: openai.OpenAI, stream: bool) -> str:
        if stream:
            chunks = client.chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                max_tokens=6,
                stream=True,  # type: ignore[arg-type]
            )
            finished = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finished[-1], "the stream ended without a finish reason"
            return chunks.response.headers["x-request-id"]
        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=6,  # type: ignore[arg-type]
        )
        assert raw.parse().choices[0].finish_reason
        return raw.headers["x-request-id"]

    def count(self, since: float = 0.0) -> int:
        with self._lock:
            return sum(1 for sent, _ in self.answered if sent >= since)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


class RetryCount(logging.Handler):
    """How many times the `openai` SDK retried a request (it logs each retry)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.retries = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Retrying request"):
            self.retries += 1

    def __enter__(self) -> RetryCount:
        sdk = logging.getLogger("openai._base_client")
        self._level = sdk.level
        sdk.setLevel(logging.INFO)
        sdk.addHandler(self)
        return self

    def __exit__(self, *_: object) -> None:
        sdk = logging.getLogger("openai._base_client")
        sdk.removeHandler(self)
        sdk.setLevel(self._level)


def usage_counts(pair: StandbyPair, server: str) -> dict[str, int]:
    rows = pair.query(server, "SELECT request_id, count(*) FROM usage_records GROUP BY 1")
    return {request_id: int(n) for request_id, n in rows}


@dataclass
class Failovers:
    committed_before: set[str] = field(default_factory=set)  # usage rows on the dead primaries
    writes_back_s: list[float] = field(default_factory=list)  # kill → the first write answered
    last_killed: str = ""


def fail_over_twice(
    pair: StandbyPair, platform: PlatformProcess, load: Load, tenant: str, models_dir: Path
) -> Failovers:
    """Two failovers under `load`, the second back to the first server (rebuilt as a standby)
    with no writable server for 3 s first; after each, a key is created and works, and after
    the first a new deploy becomes ready."""
    admin = platform.api()
    done = Failovers()

    def a_key_is_created() -> dict | None:
        r = admin.post("/v1/keys", json={"name": "after", "tenant_id": tenant})
        assert r.status_code in (201, 503), r.text  # never a 500
        return r.json() if r.status_code == 201 else None

    since = 0.0
    for failover in range(2):
        wait_until(lambda t=since: load.count(t) >= 12, f"load before failover {failover + 1}")
        done.last_killed = pair.primary
        # Committed on the primary, so acknowledged to the usage writer: it must survive.
        done.committed_before |= usage_counts(pair, pair.primary).keys()
        killed = time.monotonic()
        # The second time, as when a failover manager waits out its timeout, no server accepts
        # writes for a while: traffic goes on, writes get a 503.
        pair.fail_over(leaderless_s=3.0 * failover)
        assert not pair.in_recovery(pair.primary), "the standby was not promoted"
        new_key = wait_until(a_key_is_created, "a key created after the failover", 60, 0.1)
        done.writes_back_s.append(time.monotonic() - killed)
        # The new key works at once: the gateway reads it from the new primary.
        fresh = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=new_key["key"])
        assert fresh.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
        if failover == 0:
            # A deploy: the control plane writes its endpoint and status rows.
            second = deploy(admin, "tiny-after", str(models_dir / "tiny"), wait=False)
            wait_status(admin, second, "ready")
            pair.rebuild_standby()
        since = time.monotonic()
    wait_until(lambda: load.count(since) >= 12, "load going on after the failovers")
    return done


def test_writes_resume_on_the_promoted_standby_and_no_usage_row_is_lost(
    pair: StandbyPair, platform: PlatformProcess, models_dir: Path
) -> None:
    admin = platform.api()
    tenant = create_tenant(admin, "failover", quota=10**9)
    key = create_key(admin, tenant, rpm_limit=100_000, tpm_limit=10**8)["key"]
    deploy(admin, "tiny", str(models_dir / "tiny"), public=True)
    load = Load(platform.url, key)
    with RetryCount() as sdk:
        load.start()
        try:
            done = fail_over_twice(pair, platform, load, tenant, models_dir)
        finally:
            load.stop()
    print(
        f"failovers: first write {', '.join(f'{s:.2f}' for s in done.writes_back_s)} s after "
        f"the kill (promote {pair.promote_s:.2f} s), slowest request {load.slowest_s:.2f} s; "
        f"{len(load.answered)} answered, {len(load.failed)} failed, {sdk.retries} SDK retries"
    )
    assert not load.failed, load.failed[:5]

    answered = {request_id for _, request_id in load.answered}

    def every_answer_billed() -> dict[str, int] | None:
        counts = usage_counts(pair, pair.primary)
        return counts if answered <= counts.keys() else None

    counts = wait_until(
        every_answer_billed, "a usage row on the new primary for every answered request", 60, 0.2
    )
    assert all(n == 1 for n in counts.values()), "a request was billed twice"
    lost = done.committed_before - counts.keys()
    assert not lost, f"usage rows committed on an old primary are gone: {sorted(lost)[:5]}"
    with pytest.raises(psycopg.OperationalError):  # the last one killed is down
        pair.query(done.last_killed, "SELECT 1")
    platform.assert_no_loop_stalls()
    assert httpx.get(f"{platform.url}/health", timeout=5).status_code == 200
