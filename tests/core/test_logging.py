"""Structured logs and the request id end to end.

A real `modelyard serve` in JSON mode (log level debug, so that the worker and the engine write
their per-request lines): one chat request's gateway access line, the worker's line and the
engine's lines all carry the same request id, which is the id the client got back in
`x-request-id` and the id of the usage row; a client's own `x-request-id` is logged as
`client_request_id`, never used as the id. Plus the formatter and the id check in-process.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.config import TelemetrySettings
from modelyard.core.logs import (
    CLIENT_REQUEST_ID,
    REQUEST_ID,
    JsonFormatter,
    TextFormatter,
    setup_logging,
    valid_request_id,
)
from tests.platform_harness import PlatformProcess, deploy, tiny_models_env, wait_request_ids

# ----- in-process ------------------------------------------------------------------------------


def _record(msg: str = "hello %s", *args: Any, **extra: Any) -> logging.LogRecord:
    record = logging.LogRecord("modelyard.x", logging.INFO, __file__, 1, msg, args or ("w",), None)
    record.__dict__.update(extra)
    return record


def test_json_formatter_has_fields_request_ids_and_extras() -> None:
    tokens = REQUEST_ID.set("rid-1"), CLIENT_REQUEST_ID.set("mine")
    try:
        line = json.loads(JsonFormatter().format(_record(tenant="tn-1", tokens=3)))
    finally:
        CLIENT_REQUEST_ID.reset(tokens[1])
        REQUEST_ID.reset(tokens[0])
    assert line["level"] == "info" and line["logger"] == "modelyard.x"
    assert line["msg"] == "hello w" and line["ts"].endswith("Z")
    assert line["request_id"] == "rid-1" and line["client_request_id"] == "mine"
    assert line["tenant"] == "tn-1" and line["tokens"] == 3
    # Outside a request: no ids at all; an explicit field is kept as given.
    line = json.loads(JsonFormatter().format(_record(request_id="explicit")))
    assert line["request_id"] == "explicit" and "client_request_id" not in line


def test_json_formatter_keeps_a_traceback_inside_the_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("m", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = JsonFormatter().format(record)
    assert "\n" not in text
    assert "ValueError: boom" in json.loads(text)["exc"]


def test_text_formatter_appends_the_request_id() -> None:
    token = REQUEST_ID.set("abc")
    try:
        assert TextFormatter().format(_record()).endswith("hello w [req abc]")
    finally:
        REQUEST_ID.reset(token)
    assert "[req" not in TextFormatter().format(_record())


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("trace-42", "trace-42"),
        ("a" * 128, "a" * 128),
        ("a" * 129, None),
        ("", None),
        (None, None),
        ("bad\nline", None),
        ("tab\there", None),
        ("caf\u00e9", None),
    ],
)
def test_valid_request_id(given: str | None, kept: str | None) -> None:
    assert valid_request_id(given) == kept


def test_setup_logging_json_and_level(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    try:
        setup_logging(TelemetrySettings(log_format="json", log_level="warning"))
        logging.getLogger("modelyard.t").info("hidden")
        logging.getLogger("modelyard.t").warning("shown %d", 1, extra={"k": "v"})
        lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x]
        assert [(x["msg"], x["k"]) for x in lines] == [("shown 1", "v")]
    finally:
        root.handlers[:] = before[0]
        root.setLevel(before[1])


def test_replica_access_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica never logs its probes; under a platform (which logs each request at the
    gateway) none of uvicorn's access lines."""
    from modelyard.core.logs import _ReplicaAccessFilter

    def line(path: str) -> logging.LogRecord:
        return logging.LogRecord(
            "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
            ("127.0.0.1:1", "GET", path, "1.1", 200), None,
        )  # fmt: skip

    monkeypatch.delenv("MODELYARD_PARENT_PID", raising=False)
    alone = _ReplicaAccessFilter()
    assert not alone.filter(line("/health")) and not alone.filter(line("/metrics?x=1"))
    assert alone.filter(line("/v1/chat/completions"))
    monkeypatch.setenv("MODELYARD_PARENT_PID", "1")
    assert not _ReplicaAccessFilter().filter(line("/v1/chat/completions"))


def test_a_bad_log_format_is_one_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from modelyard.cli import app

    monkeypatch.setenv("MODELYARD_LOG_FORMAT", "xml")
    out = CliRunner().invoke(app, ["worker", "--model", "x"])
    assert out.exit_code == 2
    assert "log_format" in out.output and "Traceback" not in out.output


# ----- through a real platform -----------------------------------------------------------------


class DebugPlatform(PlatformProcess):
    """`PlatformProcess` at log level debug (the harness runs serve at warning)."""

    def start(self, timeout: float = 180.0, models_loaded: bool = True) -> PlatformProcess:
        cmd = [sys.executable, "-m", "modelyard.cli", "serve", "--port", str(self.port),
               "--data-dir", str(self.data_dir), "--no-default-models",
               "--log-level", "debug"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.output()}")
            if self._up(False):
                return self
            time.sleep(0.2)
        raise TimeoutError(f"serve did not come up:\n{self.output()}")


def json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for raw in text.splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return out


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path
) -> Iterator[PlatformProcess]:
    env = {**tiny_models_env(models_dir), "MODELYARD_LOG_FORMAT": "json"}
    p = DebugPlatform(tmp_path_factory.mktemp("logs-platform"), env)
    p.start()
    try:
        with p.api() as api:
            deploy(api, "tiny", str(models_dir / "tiny"))
        yield p
    finally:
        p.stop()


def _wait_lines(read: Any, predicate: Any, timeout: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = [x for x in json_lines(read()) if predicate(x)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _worker_logs(platform: PlatformProcess) -> str:
    return "".join(p.read_text() for p in sorted((platform.data_dir / "logs").glob("*.log")))


def test_one_request_id_from_gateway_through_worker_and_engine(platform: PlatformProcess) -> None:
    with platform.api() as api:
        r = api.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            headers={"x-request-id": "client-trace-7"},
        )
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    assert rid != "client-trace-7" and len(rid) == 32  # the gateway's own, never the client's

    access = _wait_lines(
        platform.output, lambda x: x.get("logger") == "modelyard.access" and x["request_id"] == rid
    )
    assert len(access) == 1, platform.output()
    line = access[0]
    assert line["client_request_id"] == "client-trace-7"
    assert line["model"] == "tiny" and line["kind"] == "chat.completions"
    assert line["status_code"] == 200 and line["served"] is True and line["batch"] is False
    assert line["tenant"] and line["key_id"] and line["endpoint"].startswith("ep")
    assert line["completion_tokens"] == r.json()["usage"]["completion_tokens"]
    assert line["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert line["cached_tokens"] == 0 and line["latency_ms"] > 0
    assert {"ts", "level", "msg", "version", "ttft_ms"} <= line.keys()

    # The worker's request line is written when its response ends, after the engine's lines:
    # wait for it, then read every line of the request.
    _wait_lines(
        lambda: _worker_logs(platform),
        lambda x: x.get("request_id") == rid and x.get("logger") == "modelyard.worker.requests",
    )
    worker = [x for x in json_lines(_worker_logs(platform)) if x.get("request_id") == rid]
    loggers = {x["logger"] for x in worker}
    assert "modelyard.worker.requests" in loggers, worker
    engine = [x for x in worker if x["logger"] == "modelyard.engine.async_engine"]
    assert engine and all(x["msg"].startswith(f"request {rid}-") for x in engine), engine
    assert any("queued" in x["msg"] for x in engine) and any("ended" in x["msg"] for x in engine)

    with platform.api() as api:
        rows = wait_request_ids(api, [rid])
    assert [row["request_id"] for row in rows if row["request_id"] == rid] == [rid]


def test_a_stream_logs_its_ttft_and_an_invalid_client_id_is_dropped(
    platform: PlatformProcess,
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "stream": True,
    }
    with (
        platform.api() as api,
        api.stream(
            "POST", "/v1/chat/completions", json=body, headers={"x-request-id": "x" * 200}
        ) as r,
    ):
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        assert b"[DONE]" in r.read()
    access = _wait_lines(
        platform.output, lambda x: x.get("logger") == "modelyard.access" and x["request_id"] == rid
    )
    assert len(access) == 1
    assert "client_request_id" not in access[0]
    assert access[0]["ttft_ms"] is not None and access[0]["ttft_ms"] <= access[0]["latency_ms"]


def test_every_gateway_answer_carries_a_request_id(platform: PlatformProcess) -> None:
    for answer in (
        httpx.get(f"{platform.url}/health"),
        httpx.get(f"{platform.url}/v1/models"),  # 401: no key
        httpx.post(
            f"{platform.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {platform.admin_key}"},
            json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        ),  # 404
    ):
        assert len(answer.headers["x-request-id"]) == 32, (answer.status_code, answer.headers)
    ids = {httpx.get(f"{platform.url}/health").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3
