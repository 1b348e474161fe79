"""Chaos with real processes: Redis and PostgreSQL restarted under traffic (private instances on
free ports, never the machine's shared ones), a worker killed with SIGKILL under streaming and
non-streaming load, and the whole platform killed with SIGKILL and restarted with a batch
running. After each: no request hung, failures were clean errors, every answered request has
exactly one usage row, no batch item was lost or run twice, and no event loop of the platform
or its replicas stalled (`tests/loop_stalls.py`).

What the platform does while a dependency is down (asserted here, for docs/security.md):
- Redis down, with `redis_outage = fail_closed` (the default `fail_open` is
  `tests/platform/test_redis_outage.py`'s): limits fail closed. A request whose
  limits live in Redis is refused with a 503 `limits_unavailable` and Retry-After, never served
  unlimited and unmetered; once Redis is back requests are served again, the buckets starting
  full (this Redis keeps no state across a restart). A request already being served when Redis
  goes away is still billed, and its stream ends cleanly.
- PostgreSQL down: a key looked up in the last 5 minutes is still served from its last good
  lookup (here the auth cache lasts 1 s, so the outage outlives it), and the usage writer keeps
  the rows (in memory and in the usage journal) and retries, so all are written once the
  database is back; a key with no recent good lookup gets a 503 `auth_unavailable` with
  Retry-After. Never a 500.
- A worker killed: a stream cut mid-answer ends with an error event and [DONE]; new requests
  get a prompt 503 with Retry-After until the replacement replica is ready.
- The platform killed: requests in flight get a connection error; every request answered
  before the kill is billed (its row was journaled on disk before the answer left, and the
  journal is replayed at the next start); batches resume after the restart without losing or
  repeating an item; a stream is recorded before its `[DONE]` leaves.
"""

from __future__ import annotations

import collections
import io
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos_harness import (
    Outcome,
    PostgresServer,
    RedisServer,
    Traffic,
    assert_clean,
    check_usage,
    send,
)
from tests.loop_stalls import assert_no_loop_stalls, stall_counts, stall_log_env
from tests.platform_harness import (
    PlatformProcess,
    batch_line,
    create_key,
    create_tenant,
    deploy,
    jsonl,
    read_jsonl,
    usage_rows,
    wait_batch,
    wait_status,
    wait_usage,
)
from tests.tiny_models import build_model

# Each test restarts a database or the platform under traffic: past 2 min on 2 vCPU.
pytestmark = pytest.mark.timeout(420)

# Faults injected and requests checked, for the table in docs/security.md (printed at the end).
TALLY: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


class Chaos:
    """A platform on the private PostgreSQL and Redis, restartable on the same data dir."""

    def __init__(self, data_dir: Path, env: dict[str, str]) -> None:
        self.data_dir = data_dir
        # One loop-stall log for every platform (and replica) of the module, restarts included.
        self.stall_log, self.env = stall_log_env(env)
        self.p = PlatformProcess(data_dir, self.env).start()

    def restart(self) -> None:
        self.p = PlatformProcess(self.data_dir, self.env).start()

    def tenant(self, name: str) -> tuple[str, str]:
        admin = self.p.api()
        tenant = create_tenant(admin, f"{name}-{time.time_ns()}", quota=10**9)
        # Limits on the key, so every request takes the Redis path of the limiter.
        key = create_key(admin, tenant, rpm_limit=100_000, tpm_limit=10**8)["key"]
        return tenant, key


@pytest.fixture(scope="module")
def chaos(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
    postgres_server: PostgresServer,
    cache_dir: Path,
) -> Iterator[Chaos]:
    models = tmp_path_factory.mktemp("models")
    build_model(models / "tiny", "llama")
    env = {
        "MODELYARD_DATABASE_URL": postgres_server.url,
        "MODELYARD_REDIS_URL": redis_server.url,
        # Redis down fails closed here (fail_open is tests/platform/test_redis_outage.py's).
        "MODELYARD_REDIS_OUTAGE": "fail_closed",
        "MODELYARD_LOCAL_ARTIFACT_ROOTS": json.dumps([str(models)]),
        "MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"}),
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
        "MODELYARD_BATCH_POLL_INTERVAL_S": "0.2",
        # Shorter than the PostgreSQL outage below, so that keys are looked up during it.
        "MODELYARD_AUTH_CACHE_TTL_S": "1",
    }
    c = Chaos(tmp_path_factory.mktemp("data"), env)
    try:
        deploy(c.p.api(), "tiny", str(models / "tiny"), public=True)
        yield c
    finally:
        c.p.stop()
        print(f"chaos tally: {dict(TALLY)}")


@pytest.fixture(autouse=True)
def no_loop_stalls(chaos: Chaos) -> Iterator[None]:
    """Whatever the fault, no event loop of the platform or its replicas stalls over it."""
    before = stall_counts(chaos)
    yield
    assert_no_loop_stalls(chaos, since=before)


def recovered(c: Chaos, key: str, n: int = 4, timeout: float = 60.0) -> list[Outcome]:
    """Requests after a fault, until `n` in a row are answered (the platform recovered)."""
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + timeout
    streak = 0
    while streak < n:
        assert time.monotonic() < deadline, f"did not recover: {outcomes[-3:]}"
        o = send(c.p.url, key, "tiny", stream=len(outcomes) % 2 == 0, max_tokens=6)
        outcomes.append(o)
        streak = streak + 1 if o.complete else 0
        if not o.complete:
            time.sleep(0.3)
    return outcomes


def settle_usage(
    c: Chaos, tenant: str, outcomes: list[Outcome], timeout: float = 20
) -> list[dict[str, str]]:
    """Wait (bounded) until every answered request has its row, then check the rows."""
    answered = {o.request_id for o in outcomes if o.complete}
    api = c.p.api()
    deadline = time.monotonic() + timeout
    rows = usage_rows(api, tenant_id=tenant)
    while not answered <= {r["request_id"] for r in rows} and time.monotonic() < deadline:
        time.sleep(0.2)
        rows = usage_rows(api, tenant_id=tenant)
    check_usage(outcomes, rows)
    TALLY["requests checked"] += len(outcomes)
    TALLY["usage rows checked"] += len(rows)
    return rows


def summary(outcomes: list[Outcome]) -> str:
    return str(collections.Counter((o.status, o.error) for o in outcomes))


def test_redis_restarted_under_traffic(chaos: Chaos, redis_server: RedisServer) -> None:
    tenant, key = chaos.tenant("redis-chaos")
    traffic = Traffic(chaos.p.url, key, "tiny", total=30, workers=3, max_seconds=90)
    traffic.wait_count(4)
    # Redis dies while a stream is mid-answer; the stream ends (and settles) while it is down.
    mid_stream = send(chaos.p.url, key, "tiny", stream=True, max_tokens=80,
                      on_first_data=redis_server.kill)  # fmt: skip
    TALLY["redis killed"] += 1
    time.sleep(1.0)  # the outage's length under traffic (a fault that lasts, not a wait)
    redis_server.start()
    outcomes = [*traffic.finish(), mid_stream, *recovered(chaos, key)]
    print("redis restart:", summary(outcomes), "mid-stream:", mid_stream)
    # An answer that reached the client is billed once, whatever Redis did meanwhile.
    settle_usage(chaos, tenant, outcomes)
    # Limits fail closed while Redis is away (redis_outage=fail_closed): a 503 that says when to
    # retry, never a hang or an unlimited, unmetered answer.
    assert_clean(outcomes, {503})
    refused = [o for o in outcomes if o.status == 503]
    assert refused, "no request met the outage"
    assert all(o.error == "limits_unavailable" and o.retry_after for o in refused), refused


def test_postgres_restarted_under_traffic(chaos: Chaos, postgres_server: PostgresServer) -> None:
    tenant, key = chaos.tenant("pg-chaos")
    traffic = Traffic(chaos.p.url, key, "tiny", total=36, workers=3, max_seconds=90)
    # A key of the tenant that has not been used yet: no lookup of it to fall back on.
    unused = create_key(chaos.p.api(), tenant, name="unused")["key"]
    traffic.wait_count(6)
    log_from = len(chaos.p.output())
    postgres_server.kill()
    TALLY["postgres killed"] += 1
    time.sleep(1.5)  # the auth cache (1 s) has expired: the traffic's key is looked up again
    during = [send(chaos.p.url, k, "tiny", stream=False, max_tokens=4)
              for k in (key, unused, "sk-my-no-such-key")]  # fmt: skip
    time.sleep(0.5)  # the outage goes on a while under traffic (a fault's length, not a wait)
    postgres_server.start()
    outcomes = traffic.finish() + recovered(chaos, key)
    print("postgres restart:", summary(outcomes), "during:", during)
    # The key in use is served through the outage from its last good lookup; keys that cannot
    # be checked get a 503 that says when to retry.
    assert during[0].complete, during[0]
    for refused in during[1:]:
        assert refused.status == 503 and refused.error == "auth_unavailable", refused
        assert refused.retry_after, refused
    settle_usage(chaos, tenant, [*outcomes, during[0]])
    assert_clean(outcomes, {503})
    # The outage is logged once per component, not a traceback per request, retry or poll.
    logged = chaos.p.output()[log_from:]
    assert "Traceback" not in logged, logged
    assert logged.count("batch runner: the database is unreachable") == 1, logged


def test_routes_that_need_the_database_answer_503_while_it_is_down(
    chaos: Chaos, postgres_server: PostgresServer
) -> None:
    _, key = chaos.tenant("pg-routes")
    api = chaos.p.api(key)
    assert api.get("/v1/files").status_code == 200  # the key's lookup is cached from here
    postgres_server.kill()
    TALLY["postgres killed"] += 1
    try:
        answers = [api.get(path) for path in ("/v1/files", "/v1/batches")]
    finally:
        postgres_server.start()
    for r in answers:
        assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text)
        assert r.json()["error"]["code"] == "database_unavailable", r.text


def test_worker_killed_under_streaming_and_unary_load(chaos: Chaos) -> None:
    tenant, key = chaos.tenant("worker-chaos")
    admin = chaos.p.api()
    endpoint = admin.get("/v1/endpoints").json()["data"][0]["endpoint_id"]
    before = set(chaos.p.worker_pids())
    assert before
    traffic = Traffic(chaos.p.url, key, "tiny", total=30, workers=3, max_tokens=40, max_seconds=120)
    traffic.wait_count(3)

    def kill_workers() -> None:
        for pid in before:
            os.kill(pid, signal.SIGKILL)
            TALLY["workers killed"] += 1

    # The worker dies while a long unary request and a long stream are mid-answer.
    unary: list[Outcome] = []
    thread = threading.Thread(
        target=lambda: unary.append(send(chaos.p.url, key, "tiny", False, 300))
    )
    thread.start()
    # Left as a fixed sleep: nothing observable tells the unary request in flight apart from
    # the traffic's (the stream after it kills the worker on its first token either way).
    time.sleep(0.2)
    mid_stream = send(chaos.p.url, key, "tiny", True, 300, on_first_data=kill_workers)
    thread.join(90)
    # A stream cut mid-answer ends with an error event and [DONE], not a dropped connection.
    assert mid_stream.status == 200 and mid_stream.error == "error event", mid_stream
    outcomes = [*traffic.finish(), *unary, mid_stream]
    # The replica is replaced.
    deadline = time.monotonic() + 120
    while not (set(chaos.p.worker_pids()) - before):
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(0.2)
    wait_status(admin, endpoint, "ready")
    outcomes += recovered(chaos, key)
    print("worker kill:", summary(outcomes))
    settle_usage(chaos, tenant, outcomes)
    assert_clean(outcomes, {502, 503})
    # While no replica serves, requests get a prompt 503 that says when to retry.
    assert all(o.retry_after for o in outcomes if o.status == 503), summary(outcomes)


def test_an_answer_is_billed_even_if_the_platform_dies_right_after(chaos: Chaos) -> None:
    tenant, key = chaos.tenant("sigkill-billing")
    answered: list[Outcome] = []
    for stream in (False, True):
        outcome = send(chaos.p.url, key, "tiny", stream, max_tokens=4)
        assert outcome.complete, outcome
        answered.append(outcome)
        chaos.p.stop(signal.SIGKILL)
        TALLY["platform killed"] += 1
        chaos.restart()
        admin = chaos.p.api()
        wait_status(admin, admin.get("/v1/endpoints").json()["data"][0]["endpoint_id"], "ready")
    settle_usage(chaos, tenant, answered, timeout=5)


def test_a_stream_is_billed_even_if_the_platform_dies_as_its_done_arrives(chaos: Chaos) -> None:
    """The platform is SIGKILLed the moment the client has read `[DONE]` (before the end of the
    HTTP response): the answer was whole, so it must be billed after the restart."""
    tenant, key = chaos.tenant("sigkill-at-done")
    answered: list[Outcome] = []
    for _ in range(3):
        outcome = send(chaos.p.url, key, "tiny", True, max_tokens=4,
                       on_done=lambda: chaos.p.stop(signal.SIGKILL))  # fmt: skip
        assert outcome.complete, outcome
        answered.append(outcome)
        TALLY["platform killed"] += 1
        chaos.restart()
        admin = chaos.p.api()
        wait_status(admin, admin.get("/v1/endpoints").json()["data"][0]["endpoint_id"], "ready")
    settle_usage(chaos, tenant, answered, timeout=5)


def test_platform_killed_and_restarted_with_a_batch_running(chaos: Chaos) -> None:
    tenant, key = chaos.tenant("platform-chaos")
    client = chaos.p.openai(key)
    n = 40
    lines = [batch_line(f"item-{i}", f"Story {i}", max_tokens=12, ignore_eos=True)
             for i in range(n)]  # fmt: skip
    upload = client.files.create(file=("b.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    traffic = Traffic(chaos.p.url, key, "tiny", total=30, workers=2, max_seconds=60)
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 5:
        assert time.monotonic() < deadline, "the batch did not start"
        time.sleep(0.1)
    traffic.wait_count(4)
    killed_at = time.monotonic()
    chaos.p.stop(signal.SIGKILL)
    TALLY["platform killed"] += 1
    before_restart = traffic.stop()
    chaos.restart()
    client = chaos.p.openai(key)
    admin = chaos.p.api()
    endpoint = admin.get("/v1/endpoints").json()["data"][0]["endpoint_id"]
    wait_status(admin, endpoint, "ready")
    after = Traffic(chaos.p.url, key, "tiny", total=12, workers=2, max_seconds=60).finish()
    done = wait_batch(client, batch.id, {"completed", "failed", "expired"}, timeout=180)
    assert done.status == "completed"
    out = read_jsonl(client, done.output_file_id)
    err = read_jsonl(client, done.error_file_id)
    ids = [o["custom_id"] for o in out] + [e["custom_id"] for e in err]
    assert sorted(ids) == sorted(f"item-{i}" for i in range(n)), "an item was lost or run twice"
    assert not err and done.request_counts.completed == n
    TALLY["batch items checked"] += n
    print("platform kill:", summary(before_restart + after))
    assert_clean(after, set())
    # Each batch item is billed once (its usage row is committed with its result).
    outcomes = before_restart + after
    answered_after = {o.request_id for o in after if o.complete}
    rows = wait_usage(
        admin,
        lambda rows: (
            len([r for r in rows if r["batch"] == "1"]) >= n
            and answered_after <= {r["request_id"] for r in rows}
        ),
        timeout=60,
        tenant_id=tenant,
    )
    batch_rows = [r for r in rows if r["batch"] == "1"]
    assert len(batch_rows) == len({r["request_id"] for r in batch_rows}) == n
    # Every answered request is billed once, those answered in the instant before the kill
    # too (their rows were journaled before the answers left, and replayed at the restart);
    # a request the kill cut off is billed as ok only if its row was journaled as its answer
    # was leaving (check_usage's `killed`).
    interactive = [r for r in rows if r["batch"] != "1"]
    last_moment = [o for o in before_restart if o.complete and o.ended > killed_at - 1]
    print(f"answered in the second before the kill: {len(last_moment)}")
    check_usage(outcomes, interactive, killed=True)
    TALLY["requests checked"] += len(outcomes)
    TALLY["usage rows checked"] += len(rows)
