"""Run `modelyard serve` as a real subprocess and talk to it like a user would."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai

from tests import process_logs
from tests.conftest import free_port
from tests.loop_stalls import assert_no_loop_stalls, stall_log_env


class PlatformProcess:
    def __init__(
        self,
        data_dir: Path,
        env: dict[str, str] | None = None,
        default_models: bool = False,
    ) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The loop-stall guard on, in serve and in every replica it starts (their environment
        # is serve's): `tests/loop_stalls.py`.
        self.stall_log, env = stall_log_env(env)
        self.env = {**os.environ, **env}
        self.default_models = default_models
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the process
        self.proc: subprocess.Popen[bytes] | None = None
        process_logs.register(self)  # a failing test's report shows this log

    def label(self) -> str:
        return f"modelyard serve on port {self.port} (with its replicas)"

    def start(self, timeout: float = 180.0, models_loaded: bool = True) -> PlatformProcess:
        """Run serve; return once it answers and (`models_loaded`) its default models loaded."""
        cmd = [
            sys.executable, "-m", "modelyard.cli", "serve",
            "--port", str(self.port),
            "--data-dir", str(self.data_dir),
            "--default-models" if self.default_models else "--no-default-models",
            "--log-level", "warning",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.output()}")
            if self._up(models_loaded):
                return self
            time.sleep(0.2)
        raise TimeoutError(f"serve did not come up:\n{self.output()}")

    def _up(self, models_loaded: bool) -> bool:
        """Answering /health; with default models, also done loading them: serve answers while
        they load in the background and prints its banner once they are ready (or failed)."""
        try:
            if httpx.get(f"{self.url}/health", timeout=1.0).status_code != 200:
                return False
        except httpx.HTTPError:
            return False
        if not (self.default_models and models_loaded):
            return True
        # pread, not output(): the child writes through the same file offset, which a seek moves.
        fd = self.log.fileno()
        return b"modelyard is serving on" in os.pread(fd, os.fstat(fd).st_size, 0)

    def output(self) -> str:
        return process_logs.read_log(self.log)

    @property
    def admin_key(self) -> str:
        return (self.data_dir / "admin_key").read_text().strip()

    def api(self, key: str | None = None) -> httpx.Client:
        headers = {"authorization": f"Bearer {key or self.admin_key}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60.0)

    def openai(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=key or self.admin_key, max_retries=0, timeout=60
        )

    def assert_no_loop_stalls(self) -> None:
        """Neither serve nor a replica it started had its event loop stalled."""
        assert_no_loop_stalls(self)

    def worker_pids(self) -> list[int]:
        """Worker replicas are the serve process's children."""
        if self.proc is None:
            return []
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return sorted(int(p) for p in out.stdout.split())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def platform_running(
    data_dir: Path, env: dict[str, str], default_models: bool = False, timeout: float = 180.0
) -> Iterator[PlatformProcess]:
    """A started `serve`, stopped however the block ends (a start that timed out included)."""
    p = PlatformProcess(data_dir, env, default_models)
    try:
        yield p.start(timeout)
    finally:
        p.stop()


# ----- helpers the tests share -----------------------------------------------------------------


def tiny_models_env(models_dir: Path) -> dict[str, str]:
    """Settings of a test platform serving the tiny random models in `models_dir`: deployable by
    path, a small float32 KV cache, and health checks fast enough for failure tests."""
    return {
        "MODELYARD_LOCAL_ARTIFACT_ROOTS": json.dumps([str(models_dir)]),
        "MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"}),
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
    }


def create_tenant(api: httpx.Client, name: str, quota: int | None = None) -> str:
    r = api.post("/v1/tenants", json={"name": name, "monthly_token_quota": quota})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def create_key(api: httpx.Client, tenant_id: str | None = None, **fields: Any) -> dict[str, Any]:
    body = {"name": fields.pop("name", "test"), **fields}
    if tenant_id:
        body["tenant_id"] = tenant_id
    r = api.post("/v1/keys", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def deploy(api: httpx.Client, name: str, artifact: str, wait: bool = True, **extra: Any) -> str:
    body = {"model_name": name, "model_artifact": artifact, **extra}
    r = api.post("/v1/models/deploy", json=body)
    assert r.status_code == 202, r.text
    endpoint_id = str(r.json()["endpoint_id"])
    if wait:
        wait_status(api, endpoint_id, "ready")
    return endpoint_id


def wait_status(api: httpx.Client, endpoint_id: str, status: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        r = api.get(f"/v1/endpoints/{endpoint_id}")
        if r.status_code == 404 and status == "gone":
            return {}
        body = r.json()
        if body.get("status") == status:
            return body
        if body.get("status") == "failed" and status != "failed":
            raise AssertionError(f"endpoint failed: {body}")
        time.sleep(0.2)
    raise AssertionError(f"endpoint {endpoint_id} not {status} in time: {body}")


def usage_rows(api: httpx.Client, **params: Any) -> list[dict[str, str]]:
    import csv
    import io

    r = api.get("/v1/usage/export", params=params)
    assert r.status_code == 200, r.text
    return list(csv.DictReader(io.StringIO(r.text)))


def wait_usage(
    api: httpx.Client,
    predicate: Callable[[list[dict[str, str]]], bool],
    timeout: float = 30.0,
    **params: Any,
) -> list[dict[str, str]]:
    """Usage rows (the CSV export) once `predicate(rows)` holds: the writer is asynchronous, so
    tests poll for the condition instead of sleeping a guessed time."""
    deadline = time.monotonic() + timeout
    rows = usage_rows(api, **params)
    while not predicate(rows):
        if time.monotonic() > deadline:
            raise AssertionError(f"usage never satisfied the condition; last rows: {rows}")
        time.sleep(0.1)
        rows = usage_rows(api, **params)
    return rows


def wait_request_ids(
    api: httpx.Client, request_ids: list[str], timeout: float = 30.0, **params: Any
) -> list[dict[str, str]]:
    """Usage rows once every one of `request_ids` has its row."""
    wanted = set(request_ids)

    def done(rows: list[dict[str, str]]) -> bool:
        return wanted <= {r["request_id"] for r in rows}

    return wait_usage(api, done, timeout, **params)


# ----- files and batches -----------------------------------------------------------------------


def batch_line(custom_id: str, content: str = "Hello", max_tokens: int = 4, **body: Any) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": body.pop("model", "tiny"),
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            **body,
        },
    }


def jsonl(lines: list[Any]) -> bytes:
    return (
        b"\n".join((x if isinstance(x, bytes) else json.dumps(x).encode()) for x in lines) + b"\n"
    )


def wait_batch(
    client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 120.0
) -> Any:
    deadline = time.monotonic() + timeout
    batch = client.batches.retrieve(batch_id)
    while batch.status not in statuses:
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} stuck in {batch.status}")
        time.sleep(0.2)
        batch = client.batches.retrieve(batch_id)
    return batch


def read_jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x]
