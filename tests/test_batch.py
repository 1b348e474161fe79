"""Batch inference end to end: the official `openai` client's files and batches calls against
`modelyard serve`, line validation, a kill -9 and restart in the middle of a batch, cancel,
expiry, the signed completion webhook, and metering once per item."""

from __future__ import annotations

import http.server
import io
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from modelyard.batch.validation import BatchFileInvalid, validate_file
from modelyard.batch.webhook import SIGNATURE_HEADER, verify
from tests.platform_harness import PlatformProcess, create_key, create_tenant, deploy, usage_rows
from tests.tiny_models import build_model

ENGINE = json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"})


def line(custom_id: str, content: str = "Hello", max_tokens: int = 4, **body: Any) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            **body,
        },
    }


def jsonl(lines: list[Any]) -> bytes:
    return (
        b"\n".join((x if isinstance(x, bytes) else json.dumps(x).encode()) for x in lines) + b"\n"
    )


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


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


class Setup:
    def __init__(self, platform: PlatformProcess, tiny_dir: Path) -> None:
        self.platform = platform
        admin = platform.api()
        if not admin.get("/v1/endpoints").json()["data"]:
            deploy(admin, "tiny", str(tiny_dir), public=True)
        tenant = create_tenant(admin, f"batch-{time.time_ns()}")
        self.tenant = tenant
        self.key = create_key(admin, tenant)["key"]
        self.client = platform.openai(self.key)
        self.admin = admin


def start(data_dir: Path, **env: str) -> PlatformProcess:
    base = {
        "MODELYARD_WORKER_ENGINE": ENGINE,
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
        "MODELYARD_BATCH_POLL_INTERVAL_S": "0.2",
    }
    return PlatformProcess(data_dir, {**base, **env}).start()


@pytest.fixture()
def setup(tmp_path: Path, tiny_dir: Path, cache_dir: Path) -> Iterator[Setup]:
    p = start(tmp_path / "data")
    try:
        yield Setup(p, tiny_dir)
    finally:
        p.stop()


def wait_batch(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} stuck in {batch.status}")


def read_jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x]


def test_files_api_and_isolation(setup: Setup) -> None:
    c = setup.client
    data = jsonl([line("x")])
    created = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert created.object == "file" and created.bytes == len(data) and created.purpose == "batch"
    assert c.files.retrieve(created.id).filename == "in.jsonl"
    assert c.files.content(created.id).content == data
    assert created.id in [f.id for f in c.files.list(purpose="batch")]
    other = setup.platform.openai(create_key(setup.admin, create_tenant(setup.admin, "o2"))["key"])
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
    lines: list[Any] = [line(f"req-{i}", f"Question {i}", max_tokens=3 + i % 3) for i in range(40)]
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
    time.sleep(0.3)
    rows = usage_rows(setup.admin, tenant_id=setup.tenant)
    assert len(rows) == 40 and all(r["batch"] == "1" for r in rows)
    assert len({r["request_id"] for r in rows}) == 40
    billed = {r["request_id"]: int(r["completion_tokens"]) for r in rows}
    assert sum(billed.values()) == sum(o["response"]["body"]["usage"]["completion_tokens"]
                                       for o in out)  # fmt: skip
    listed = c.batches.list(limit=5)
    assert listed.data[0].id == batch.id


def test_kill_and_restart_mid_batch_loses_and_repeats_nothing(
    tmp_path: Path, tiny_dir: Path, cache_dir: Path
) -> None:
    data = tmp_path / "data"
    first = start(data)
    try:
        s = Setup(first, tiny_dir)
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
    second = start(data)
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
        time.sleep(0.3)
        rows = usage_rows(second.api(), tenant_id=s.tenant)
        assert len(rows) == len({r["request_id"] for r in rows}) == 200
    finally:
        second.stop()


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
    lines = [line(f"e-{i}", max_tokens=80, ignore_eos=True) for i in range(200)]
    upload = c.files.create(file=("e.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = c.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="4s"
    )
    done = wait_batch(c, batch.id, {"expired"}, timeout=60)
    out = read_jsonl(c, done.output_file_id)
    err = read_jsonl(c, done.error_file_id)
    assert out and err and len(out) + len(err) == 200
    assert {e["error"]["code"] for e in err} == {"batch_expired"}
    assert done.expired_at


def test_signed_webhook_on_completion(tmp_path: Path, tiny_dir: Path, cache_dir: Path) -> None:
    received: list[tuple[bytes, str]] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        calls = 0

        def do_POST(self) -> None:
            Hook.calls += 1
            body = self.rfile.read(int(self.headers["content-length"]))
            if Hook.calls == 1:  # the first try fails: the sender must retry
                self.send_response(500)
            else:
                received.append((body, self.headers[SIGNATURE_HEADER]))
                self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    p = start(tmp_path / "data")
    try:
        s = Setup(p, tiny_dir)
        upload = s.client.files.create(
            file=("w.jsonl", io.BytesIO(jsonl([line("w1"), line("w2")]))), purpose="batch"
        )
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        batch = s.client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
            metadata={"webhook_url": url},
        )  # fmt: skip
        wait_batch(s.client, batch.id, {"completed"})
        deadline = time.monotonic() + 20
        while not received and time.monotonic() < deadline:
            time.sleep(0.1)
        body, signature = received[0]
        secret = (p.data_dir / "webhook_secret").read_text().strip()
        assert verify(secret, body, signature)
        assert not verify("wrong-secret", body, signature)
        payload = json.loads(body)
        assert payload["id"] == batch.id and payload["status"] == "completed"
        assert Hook.calls == 2
    finally:
        p.stop()
        server.shutdown()
