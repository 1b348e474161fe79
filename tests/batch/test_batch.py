"""Batch inference end to end: the official `openai` client's files and batches calls against
`modelyard serve` in both platform modes (SQLite + memory, PostgreSQL + Redis), line validation,
a kill -9 and restart in the middle of a batch, cancel, expiry, a revoked key stopping its batch,
the signed completion webhook (allowlist, no redirects, per-tenant Standard Webhooks secret,
checked with independent verifiers), and metering once per item.

The runner's own dispatch rules (the batch budget shared per tenant and capped globally, batch
items yielding to interactive traffic, no item sent twice when a pass fails, a deleted input file)
are tested in process at the end, with the real runner, database and files, and a stand-in for
the gateway that counts what is in flight (the property under test is what the runner sends, and
a deterministic count needs the stand-in)."""

from __future__ import annotations

import asyncio
import http.server
import io
import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from modelyard.batch.files import FileService
from modelyard.batch.runner import BatchRunner
from modelyard.batch.service import BatchService
from modelyard.batch.validation import BatchFileInvalid, validate_file
from modelyard.batch.webhook_policy import WebhookPolicy
from modelyard.config import PlatformSettings
from modelyard.core.backfill import Backfill
from modelyard.core.identity import Limits, Principal
from modelyard.core.routing import CapacityReport, EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.gateway.accounting import ItemUsage
from modelyard.gateway.metering import UsageEvent
from modelyard.store import repository as repo
from modelyard.store.artifacts import ArtifactStore
from modelyard.store.db import Database
from modelyard.store.tables import Batch, BatchItem, UsageRecord
from tests.databases import platform_mode_env
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
    wait_usage,
)
from tests.tiny_models import build_model
from tests.waiting import async_wait_until

ENGINE = json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"})
line = batch_line


# ----- validation, no server ------------------------------------------------------------------


def test_bad_lines_are_set_aside_and_a_wholly_bad_file_fails(tmp_path: Path) -> None:
    f = tmp_path / "in.jsonl"
    f.write_bytes(
        jsonl(
            [
                line("a"),
                b"{not json",
                {**line("b"), "url": "/v1/completions"},
                line("a"),  # duplicate
                {**line("c"), "method": "GET"},
                {"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": {}},
                line("e", stream=True),
                line("f"),
            ]
        )
    )
    good, bad = validate_file(f, "/v1/chat/completions")
    assert [g.custom_id for g in good] == ["a", "f"]
    assert [(b.line, b.code) for b in bad] == [
        (2, "invalid_json_line"),
        (3, "mismatched_url"),
        (4, "duplicate_custom_id"),
        (5, "invalid_method"),
        (6, "missing_model"),
        (7, "stream_not_allowed"),
    ]
    f.write_bytes(b"hello\nworld\n")
    with pytest.raises(BatchFileInvalid) as info:
        validate_file(f, "/v1/chat/completions")
    assert [e["line"] for e in info.value.errors] == [1, 2]


# ----- end to end -----------------------------------------------------------------------------


class Hook(http.server.ThreadingHTTPServer):
    """A webhook receiver on 127.0.0.1 that records each request and answers `status`."""

    def __init__(self, status: int = 204, location: str | None = None) -> None:
        self.status = status
        self.location = location
        self.received: list[tuple[dict[str, str], bytes]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(outer.status)
                if outer.location:
                    self.send_header("location", outer.location)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def wait(self, n: int = 1, timeout: float = 30.0) -> list[tuple[dict[str, str], bytes]]:
        deadline = time.monotonic() + timeout
        while len(self.received) < n:
            assert time.monotonic() < deadline, f"{n} webhooks never came: {self.received}"
            time.sleep(0.05)
        return self.received


class Hooks:
    """The receivers a platform knows: `ok` and `redirect` are allowlisted, `elsewhere` (where
    `redirect` points) is not, `operator` is the platform-wide `batch_webhook_url`."""

    def __init__(self) -> None:
        self.ok = Hook()
        self.elsewhere = Hook()
        self.redirect = Hook(307, location=f"http://localhost:{self.elsewhere.port}/stolen")
        self.operator = Hook()
        self.all = (self.ok, self.elsewhere, self.redirect, self.operator)

    def env(self) -> dict[str, str]:
        allowed = [f"127.0.0.1:{self.ok.port}", f"127.0.0.1:{self.redirect.port}"]
        return {
            "MODELYARD_BATCH_WEBHOOK_HOSTS": json.dumps(allowed),
            "MODELYARD_BATCH_WEBHOOK_URL": self.operator.url,
        }

    def close(self) -> None:
        for hook in self.all:
            hook.shutdown()
            hook.server_close()


def start(data_dir: Path, **env: str) -> PlatformProcess:
    base = {
        "MODELYARD_WORKER_ENGINE": ENGINE,
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
        "MODELYARD_BATCH_POLL_INTERVAL_S": "0.2",
    }
    return PlatformProcess(data_dir, {**base, **env}).start()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


@pytest.fixture(scope="module")
def hooks() -> Iterator[Hooks]:
    made = Hooks()
    yield made
    made.close()


@pytest.fixture(scope="module")
def platform(
    platform_env: dict[str, str],
    hooks: Hooks,
    tiny_dir: Path,
    cache_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PlatformProcess]:
    """One platform per mode for the module's tests (each test has its own tenant)."""
    p = start(tmp_path_factory.mktemp("data"), **platform_env, **hooks.env())
    try:
        deploy(p.api(), "tiny", str(tiny_dir), public=True)
        yield p
    finally:
        p.stop()


class Setup:
    def __init__(self, platform: PlatformProcess) -> None:
        self.platform = platform
        admin = platform.api()
        tenant = create_tenant(admin, f"batch-{time.time_ns()}")
        self.tenant = tenant
        created = create_key(admin, tenant)
        self.key, self.key_id = created["key"], created["id"]
        self.client = platform.openai(self.key)
        self.admin = admin


@pytest.fixture()
def setup(platform: PlatformProcess) -> Setup:
    return Setup(platform)


def test_files_api_and_isolation(setup: Setup) -> None:
    c = setup.client
    data = jsonl([line("x")])
    created = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert created.object == "file" and created.bytes == len(data) and created.purpose == "batch"
    assert c.files.retrieve(created.id).filename == "in.jsonl"
    assert c.files.content(created.id).content == data
    assert created.id in [f.id for f in c.files.list(purpose="batch")]
    other_tenant = create_tenant(setup.admin, f"o2-{time.time_ns()}")
    other = setup.platform.openai(create_key(setup.admin, other_tenant)["key"])
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(created.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=created.id, endpoint="/v1/chat/completions",
                             completion_window="24h")  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        c.files.create(file=("x.jsonl", io.BytesIO(data)), purpose="fine-tune-nope")
    assert c.files.delete(created.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(created.id)


def test_batch_with_bad_lines_completes_and_bills_each_item_once(setup: Setup) -> None:
    c = setup.client
    # EOS ignored: the tiny model samples, and an early EOS (seen in CI) would shorten req-4.
    lines: list[Any] = [
        line(f"req-{i}", f"Question {i}", max_tokens=3 + i % 3, ignore_eos=True) for i in range(40)
    ]
    lines += [b"garbage", {**line("bad-url"), "url": "/v1/embeddings"}, line("req-0")]
    lines.append(line("unknown-model", model="nope"))
    upload = c.files.create(file=("b.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = c.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job_name": "t"},
    )
    assert batch.status == "validating" and batch.metadata == {"job_name": "t"}
    assert batch.expires_at - batch.created_at == 24 * 3600
    done = wait_batch(c, batch.id, {"completed", "failed"})
    assert done.status == "completed"
    assert done.request_counts.total == 44
    assert (done.request_counts.completed, done.request_counts.failed) == (40, 4)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = read_jsonl(c, done.output_file_id)
    err = read_jsonl(c, done.error_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(40))
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in out)
    sample = next(o for o in out if o["custom_id"] == "req-4")
    assert sample["response"]["body"]["usage"]["completion_tokens"] == 3 + 4 % 3
    codes = {e["custom_id"]: e["error"]["code"] for e in err}
    assert codes["unknown-model"] == "model_not_found"
    assert codes["line-41"] == "invalid_json_line"
    assert codes["bad-url"] == "mismatched_url" and "duplicate_custom_id" in codes.values()
    rows = wait_usage(setup.admin, lambda r: len(r) >= 40, tenant_id=setup.tenant)
    assert len(rows) == 40 and all(r["batch"] == "1" for r in rows)
    assert len({r["request_id"] for r in rows}) == 40
    billed = {r["request_id"]: int(r["completion_tokens"]) for r in rows}
    assert sum(billed.values()) == sum(o["response"]["body"]["usage"]["completion_tokens"]
                                       for o in out)  # fmt: skip
    listed = c.batches.list(limit=5)
    assert listed.data[0].id == batch.id


def test_cancel_keeps_finished_items(setup: Setup) -> None:
    c = setup.client
    lines = [line(f"c-{i}", max_tokens=60, ignore_eos=True) for i in range(300)]
    upload = c.files.create(file=("c.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = c.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while c.batches.retrieve(batch.id).request_counts.completed < 5:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert c.batches.cancel(batch.id).status == "cancelling"
    done = wait_batch(c, batch.id, {"cancelled"})
    assert done.cancelling_at and done.cancelled_at
    out = read_jsonl(c, done.output_file_id)
    assert 5 <= len(out) < 300 and len(out) == done.request_counts.completed
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(batch.id)


def test_expiry_keeps_partial_results(setup: Setup) -> None:
    c = setup.client
    # Far more work than 4 s hold (96,000 tokens: a fast machine served 200 x 80 in time).
    lines = [line(f"e-{i}", max_tokens=240, ignore_eos=True) for i in range(400)]
    upload = c.files.create(file=("e.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = c.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="4s"
    )
    done = wait_batch(c, batch.id, {"expired"}, timeout=60)
    out = read_jsonl(c, done.output_file_id)
    err = read_jsonl(c, done.error_file_id)
    assert out and err and len(out) + len(err) == 400
    assert {e["error"]["code"] for e in err} == {"batch_expired"}
    assert done.expired_at


def test_kill_and_restart_mid_batch_loses_and_repeats_nothing(
    request: pytest.FixtureRequest,
    platform_env: dict[str, str],
    tiny_dir: Path,
    cache_dir: Path,
    tmp_path: Path,
) -> None:
    # Its own platform and (in the PostgreSQL mode) its own database: the module's platform
    # must not pick up this batch while this one is down.
    mode = request.node.callspec.params["platform_env"]
    with platform_mode_env(mode) as env:
        data = tmp_path / "data"
        first = start(data, **env)
        try:
            s = Setup(first)
            deploy(s.admin, "tiny", str(tiny_dir), public=True)
            lines = [line(f"item-{i}", f"Tell me about {i}", max_tokens=24) for i in range(200)]
            lines.insert(50, b"{broken")
            upload = s.client.files.create(
                file=("big.jsonl", io.BytesIO(jsonl(lines))), purpose="batch"
            )
            batch = s.client.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            deadline = time.monotonic() + 120
            while s.client.batches.retrieve(batch.id).request_counts.completed < 30:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        finally:
            first.stop(signal.SIGKILL)
        second = start(data, **env)
        try:
            client = second.openai(s.key)
            assert client.batches.retrieve(batch.id).status == "in_progress"
            done = wait_batch(client, batch.id, {"completed"}, timeout=240)
            out = read_jsonl(client, done.output_file_id)
            err = read_jsonl(client, done.error_file_id)
            ids = [o["custom_id"] for o in out] + [e["custom_id"] for e in err]
            assert len(ids) == len(set(ids)) == 201  # every line exactly once
            assert sorted(o["custom_id"] for o in out) == sorted(f"item-{i}" for i in range(200))
            assert done.request_counts.completed == 200 and done.request_counts.failed == 1
            rows = wait_usage(second.api(), lambda r: len(r) >= 200, tenant_id=s.tenant)
            assert len(rows) == len({r["request_id"] for r in rows}) == 200
        finally:
            second.stop()


def test_revoking_the_key_stops_its_batch_and_its_billing(setup: Setup) -> None:
    c = setup.client
    reader = setup.platform.openai(create_key(setup.admin, setup.tenant, name="reader")["key"])
    lines = [line(f"r-{i}", max_tokens=40, ignore_eos=True) for i in range(200)]
    upload = c.files.create(file=("r.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = c.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while reader.batches.retrieve(batch.id).request_counts.completed < 3:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert setup.admin.delete(f"/v1/keys/{setup.key_id}").status_code == 200
    done = wait_batch(reader, batch.id, {"cancelled", "completed", "failed"}, timeout=60)
    assert done.status == "cancelled"
    assert done.errors is not None and done.errors.data[0].code == "api_key_revoked"
    out = read_jsonl(reader, done.output_file_id)
    assert 3 <= len(out) == done.request_counts.completed < 200
    # Billed exactly the items that finished, and nothing after.
    rows = wait_usage(setup.admin, lambda r: len(r) >= len(out), tenant_id=setup.tenant)
    assert {r["request_id"] for r in rows} == {o["response"]["request_id"] for o in out}
    # An absence can only be watched for a while (no state says "nothing more will come"): a
    # runner still sending would bill more within this window.
    time.sleep(1.0)
    assert len(usage_rows(setup.admin, tenant_id=setup.tenant)) == len(out)
    assert reader.batches.retrieve(batch.id).request_counts.completed == len(out)


def _secret(platform: PlatformProcess, key: str | None = None) -> str:
    r = platform.api(key).get("/v1/webhooks/secret")
    assert r.status_code == 200, r.text
    return str(r.json()["secret"])


def _verified(secret: str, received: tuple[dict[str, str], bytes]) -> dict[str, Any]:
    """The event, checked by both independent verifiers (never by modelyard's own code)."""
    headers, body = received
    payload: dict[str, Any] = Webhook(secret).verify(body, headers)
    unwrapped = openai.OpenAI(api_key="unused", webhook_secret=secret).webhooks.unwrap(
        body, headers
    )
    assert unwrapped.data.id == payload["data"]["id"] and unwrapped.type == payload["type"]
    return payload


def _run(client: openai.OpenAI, metadata: dict[str, str] | None = None) -> str:
    upload = client.files.create(
        file=("w.jsonl", io.BytesIO(jsonl([line("w1"), line("w2")]))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
        metadata=metadata,
    )  # fmt: skip
    wait_batch(client, batch.id, {"completed"})
    return batch.id


def _event_for(hook: Hook, batch_id: str, timeout: float = 30.0) -> tuple[dict[str, str], bytes]:
    deadline = time.monotonic() + timeout
    while True:
        for received in list(hook.received):
            if json.loads(received[1])["data"]["id"] == batch_id:
                return received
        assert time.monotonic() < deadline, f"no webhook for {batch_id}: {hook.received}"
        time.sleep(0.05)


def test_webhooks_go_only_where_allowed_signed_with_the_tenants_secret(
    setup: Setup, hooks: Hooks
) -> None:
    p, c = setup.platform, setup.client
    upload = c.files.create(file=("w.jsonl", io.BytesIO(jsonl([line("w")]))), purpose="batch")
    refused = [
        hooks.elsewhere.url,  # another loopback port
        f"http://localhost:{hooks.ok.port}/hook",  # the allowed port, but not the allowed host
        f"http://10.0.0.1:{hooks.ok.port}/hook",  # private; refused before any connection
        "http://169.254.169.254/latest/meta-data",
        "file:///etc/passwd",
    ]
    for url in refused:
        with pytest.raises(openai.BadRequestError) as info:
            c.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions",
                completion_window="24h", metadata={"webhook_url": url},
            )  # fmt: skip
        assert info.value.body["param"] == "metadata.webhook_url"  # type: ignore[index]

    # Delivered to the allowlisted receiver, verifiable with the secret the tenant can read.
    secret = _secret(p, setup.key)
    assert secret.startswith("whsec_") and secret != _secret(p)  # not the system tenant's
    first = _run(c, {"webhook_url": hooks.ok.url})
    got = _event_for(hooks.ok, first)
    event = _verified(secret, got)
    assert event["type"] == "batch.completed" and event["data"]["status"] == "completed"
    with pytest.raises(WebhookVerificationError):
        Webhook(_secret(p)).verify(got[1], got[0])  # another tenant's secret does not verify

    # A 307 is not followed: the receiver it points to hears nothing.
    before = len(hooks.redirect.received)
    _run(c, {"webhook_url": hooks.redirect.url})
    hooks.redirect.wait(before + 1)

    # Rotation: later webhooks are signed with the new secret only.
    rotated = setup.platform.api(setup.key).post("/v1/webhooks/secret/rotate").json()["secret"]
    assert rotated != secret and _secret(p, setup.key) == rotated
    third = _run(c, {"webhook_url": hooks.ok.url})
    got = _event_for(hooks.ok, third)
    assert _verified(rotated, got)["data"]["id"] == third
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(got[1], got[0])

    # The operator's URL hears of the system tenant's batches only, signed with its secret.
    quiet = _run(c)  # a tenant batch without its own URL: told to nobody
    system = _run(p.openai())
    assert _verified(_secret(p), _event_for(hooks.operator, system))["data"]["id"] == system
    told = {json.loads(b)["data"]["id"] for _, b in hooks.operator.received}
    assert not told & {first, third, quiet}
    assert hooks.elsewhere.received == []


def test_webhook_secret_needs_a_key_of_the_tenant(setup: Setup) -> None:
    anonymous = httpx.get(f"{setup.platform.url}/v1/webhooks/secret")
    assert anonymous.status_code == 401
    other = create_key(setup.admin, create_tenant(setup.admin, f"w-{time.time_ns()}"))["key"]
    assert _secret(setup.platform, other) != _secret(setup.platform, setup.key)


# ----- the runner's dispatch, in process ------------------------------------------------------


class CountingGateway:
    """Stands in for the gateway under the real runner: answers each item after `hold_s` (or
    when `gate` opens) and records how many items were in flight, per tenant and in all, and
    whether one item was ever sent while it was still in flight."""

    def __init__(self, hold_s: float = 0.05) -> None:
        self.hold_s = hold_s
        self.gate = asyncio.Event()
        self.gate.set()
        self.in_flight: dict[str, set[str]] = {}
        self.peak: dict[str, int] = {}
        self.peak_all = 0
        self.sent: list[str] = []
        self.twice: list[str] = []

    async def settle_item(self, usage: ItemUsage, recorded: bool) -> None:
        """No quota here (its tenants have none): nothing is held to settle."""
        assert usage.held is None

    async def run_internal(
        self, principal: Principal, kind: str, payload: dict[str, Any], request_id: str
    ) -> tuple[int, dict[str, Any], ItemUsage | None]:
        tenant = self.in_flight.setdefault(principal.tenant_id, set())
        if any(request_id in ids for ids in self.in_flight.values()):
            self.twice.append(request_id)
        tenant.add(request_id)
        self.sent.append(request_id)
        self.peak[principal.tenant_id] = max(self.peak.get(principal.tenant_id, 0), len(tenant))
        self.peak_all = max(self.peak_all, sum(len(v) for v in self.in_flight.values()))
        try:
            await self.gate.wait()
            await asyncio.sleep(self.hold_s)
        finally:
            tenant.discard(request_id)
        usage = UsageEvent(
            request_id=request_id, tenant_id=principal.tenant_id, key_id=principal.key_id,
            endpoint_id=None, model="tiny", version_id=None, kind=kind, prompt_tokens=3,
            completion_tokens=2, cached_tokens=0, latency_ms=1.0, ttft_ms=None,
            status_code=200, status="ok", batch=True,
        )  # fmt: skip
        return (
            200,
            {"object": "chat.completion", "usage": {"total_tokens": 5}},
            ItemUsage(usage, None),
        )


class Runner:
    """The real `BatchRunner` on a real SQLite database and file store."""

    def __init__(self, tmp: Path, **settings: Any) -> None:
        self.db = Database(f"sqlite:///{tmp / 'db.sqlite'}")
        self.db.migrate()
        self.files = FileService(self.db, ArtifactStore(tmp / "artifacts"), 1 << 30)
        self.batches = BatchService(self.db, self.files, WebhookPolicy([]))
        self.routing = RoutingTable()
        self.gateway = CountingGateway()
        base = {"data_dir": tmp, "batch_poll_interval_s": 0.05, **settings}
        self.runner = BatchRunner(
            PlatformSettings(**base),
            self.db,
            self.files,
            sender=self.gateway,
            routing=self.routing,
        )
        self.tmp = tmp
        # What the runner did, counted through to the real calls: the looks it took at an
        # endpoint's load (before sending an item) and its passes over the active batches. A
        # test that something is NOT done waits for a few of these instead of a guessed time.
        self.looks = 0
        self.passes = 0
        resolve, active_ids = self.routing.resolve, self.runner._active_ids

        def counted_resolve(*args: Any, **kwargs: Any) -> EndpointRoute | None:
            self.looks += 1
            return resolve(*args, **kwargs)

        def counted_active_ids() -> list[str]:
            self.passes += 1
            return active_ids()

        self.routing.resolve = counted_resolve  # type: ignore[method-assign]
        self.runner._active_ids = counted_active_ids  # type: ignore[method-assign]

    async def after(self, count: str, more: int = 3) -> None:
        """Once the runner has taken `more` further looks (`count` "looks") or passes."""
        target = getattr(self, count) + more
        await async_wait_until(lambda: getattr(self, count) >= target, f"{more} more {count}", 30)

    def tenant(self, name: str, **ceilings: Any) -> Principal:
        with self.db.session() as s:
            t = repo.create_tenant(s, name, None, **ceilings)
            k = repo.add_key(s, t.id, "k", f"hash-{name}", "sk-", ["inference"], None, None)
            return Principal(k.id, "k", t.id, name, frozenset({"inference"}), Limits(None, None),
                             None, False)  # fmt: skip

    def batch(self, who: Principal, n: int) -> str:
        source = self.tmp / f"in-{time.time_ns()}.jsonl"
        source.write_bytes(jsonl([line(f"i-{i}") for i in range(n)]))
        f = self.files.create_from_path(who.tenant_id, source, "in.jsonl", "batch")
        created = self.batches.create(who, f["id"], "/v1/chat/completions", "24h", None)
        return str(created["id"])

    def status(self, batch_id: str) -> dict[str, Any]:
        return self.batches.get(self._tenant_of(batch_id), batch_id)

    def _tenant_of(self, batch_id: str) -> str:
        with self.db.session() as s:
            b = s.get(Batch, batch_id)
            assert b is not None
            return b.tenant_id

    async def until(self, batch_ids: list[str], statuses: set[str], within_s: float = 30) -> None:
        deadline = time.monotonic() + within_s
        while True:
            views = [await asyncio.to_thread(self.status, b) for b in batch_ids]
            if all(v["status"] in statuses for v in views):
                return
            assert time.monotonic() < deadline, [v["status"] for v in views]
            await asyncio.sleep(0.05)

    def items(self, batch_id: str) -> list[BatchItem]:
        with self.db.session() as s:
            return list(s.scalars(select(BatchItem).where(BatchItem.batch_id == batch_id)))

    def usage(self) -> list[str]:
        with self.db.session() as s:
            return list(s.scalars(select(UsageRecord.request_id)))


async def test_batches_of_a_tenant_share_one_budget_under_a_global_cap(tmp_path: Path) -> None:
    r = Runner(tmp_path, batch_concurrency=3, batch_max_concurrency=5)
    busy = r.tenant("busy")  # the platform default: 3
    capped = r.tenant("capped", max_concurrent_batch_items=1)
    third = r.tenant("third")
    batches = [r.batch(busy, 12) for _ in range(3)] + [r.batch(capped, 6), r.batch(third, 12)]
    r.runner.start()
    try:
        await r.until(batches, {"completed"})
    finally:
        await r.runner.stop()
    g = r.gateway
    assert g.peak[busy.tenant_id] == 3  # three batches, one budget
    assert g.peak[capped.tenant_id] == 1
    assert g.peak_all <= 5
    assert sorted(g.sent) == sorted(set(g.sent)) and len(g.sent) == 3 * 12 + 6 + 12


async def test_batch_items_wait_while_interactive_requests_fill_the_endpoint(
    tmp_path: Path,
) -> None:
    r = Runner(tmp_path)
    who = r.tenant("t")
    replica = ReplicaRoute("r1", "http://127.0.0.1:1", max_concurrency=2, outstanding=2)
    route = EndpointRoute(
        endpoint_id="ep-1", tenant_id=who.tenant_id, model_name="tiny", public=False,
        version_id=None, max_tokens_cap=64, replicas=[replica],
    )  # fmt: skip
    r.routing.publish(route)
    batch = r.batch(who, 4)
    r.runner.start()
    try:
        await r.until([batch], {"in_progress"})
        await r.after("looks")  # the runner looked at the endpoint, and held its item back
        assert r.gateway.sent == []  # the replica is full of interactive requests
        queued = route.queue.join(0, 256)  # and one more waits for admission
        replica.outstanding = 1  # a slot frees: it is the queued request's
        await r.after("looks")
        assert r.gateway.sent == []
        route.queue.leave(queued)  # admitted; then the interactive load is gone
        replica.outstanding = 0
        await r.until([batch], {"completed"})
    finally:
        await r.runner.stop()
    assert len(r.gateway.sent) == 4


async def test_batch_items_go_only_where_the_replica_reports_free_slots_and_kv(
    tmp_path: Path,
) -> None:
    r = Runner(tmp_path, backfill_reserved_slots=1, admission_tokens_per_request=100)
    who = r.tenant("t")
    replica = ReplicaRoute("r1", "http://127.0.0.1:1", max_concurrency=8)
    route = EndpointRoute(
        endpoint_id="ep-1", tenant_id=who.tenant_id, model_name="tiny", public=False,
        version_id=None, max_tokens_cap=64, replicas=[replica],
    )  # fmt: skip
    r.routing.publish(route)
    # Only the reserved slot is free: nothing goes.
    r.routing.set_report(route, replica, CapacityReport(1, 10_000, 0))
    batch = r.batch(who, 4)
    r.runner.start()
    try:
        await r.until([batch], {"in_progress"})
        await r.after("looks")
        assert r.gateway.sent == []
        # Slots, but not the KV one item needs: nothing goes either.
        r.routing.set_report(route, replica, CapacityReport(4, 99, 0))
        await r.after("looks")
        assert r.gateway.sent == []
        # Both, but this process sent three requests there since the report: one slot left,
        # and it is the reserved one.
        replica.outstanding = 3
        r.routing.set_report(route, replica, CapacityReport(4, 10_000, 0))
        await r.after("looks")
        assert r.gateway.sent == [] and r.runner.budget.held_back > 0
        replica.outstanding = 0  # they finished: the batch runs
        route.notify()
        await r.until([batch], {"completed"})
    finally:
        await r.runner.stop()
    assert len(r.gateway.sent) == 4


def test_batch_items_in_flight_never_hold_an_interactive_request_back() -> None:
    replica = ReplicaRoute("r1", "http://127.0.0.1:1", max_concurrency=2)
    route = EndpointRoute(
        endpoint_id="ep-1", tenant_id="t", model_name="tiny", public=False,
        version_id=None, max_tokens_cap=64, replicas=[replica],
    )  # fmt: skip
    replica.outstanding = replica.batch_outstanding = 2  # full of batch items
    assert RoutingTable.pick(route, backfill=Backfill()) is None  # no more batch
    assert RoutingTable.pick(route) is replica  # an interactive request goes (the engine
    replica.outstanding += 1  # preempts a batch item for it)
    assert RoutingTable.pick(route) is replica
    replica.outstanding += 1  # two interactive: the admission limit, as without batch
    assert RoutingTable.pick(route) is None
    route.release(replica, batch=True)
    assert (replica.outstanding, replica.batch_outstanding) == (3, 1)
    assert RoutingTable.pick(route) is None


async def test_a_failing_pass_never_sends_an_item_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = Runner(tmp_path, batch_concurrency=4)
    r.gateway.hold_s = 0.3
    who = r.tenant("t")
    batch = r.batch(who, 16)
    runner = r.runner
    calls, raised = 0, False
    real = runner._stop_reason

    def flaky(batch_id: str) -> Any:
        nonlocal calls, raised
        calls += 1
        if not raised and any(r.gateway.in_flight.values()):  # mid-loop, items in flight
            raised = True
            raise RuntimeError("database went away")
        return real(batch_id)

    monkeypatch.setattr(runner, "_stop_reason", flaky)
    runner.start()
    try:
        await r.until([batch], {"completed"})
    finally:
        await runner.stop()
    assert raised
    assert r.gateway.twice == []
    items = r.items(batch)
    assert len(items) == 16 and all(i.status == "done" for i in items)
    assert sorted(r.usage()) == sorted({f"{batch}:{i.id}" for i in items})


async def test_a_deleted_input_file_fails_the_batch_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    r = Runner(tmp_path)
    who = r.tenant("t")
    batch = r.batch(who, 3)
    file_id = r.status(batch)["input_file_id"]
    r.files.delete(who.tenant_id, file_id)
    caplog.set_level(logging.WARNING, logger="modelyard.batch")
    r.runner.start()
    try:
        await r.until([batch], {"failed"}, within_s=10)
        await r.after("passes")  # a few more polls: the batch is not looked at again
    finally:
        await r.runner.stop()
    view = r.status(batch)
    assert view["errors"]["data"][0]["code"] == "input_file_missing"
    assert view["failed_at"] is not None
    assert [rec for rec in caplog.records if rec.exc_info] == []
    assert r.gateway.sent == []


def test_a_runner_refuses_a_sender_that_cannot_settle_its_items(tmp_path: Path) -> None:
    """The runner once called a verb its sender no longer had, after each item's commit: every
    item's usage skipped the quota, one AttributeError at a time. Now a sender missing either
    verb stops the runner from being made at all."""

    class SendsOnly:  # what the gateway looked like to the runner after `count` went
        async def run_internal(
            self, principal: Principal, kind: str, payload: dict[str, Any], request_id: str
        ) -> tuple[int, dict[str, Any], ItemUsage | None]:
            return 500, {}, None

    db = Database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    files = FileService(db, ArtifactStore(tmp_path / "artifacts"), 1 << 30)
    settings = PlatformSettings(data_dir=tmp_path)
    with pytest.raises(TypeError, match="cannot send and settle"):
        BatchRunner(settings, db, files, sender=SendsOnly(), routing=RoutingTable())
    BatchRunner(settings, db, files, sender=CountingGateway(), routing=RoutingTable())
