"""Run `modelyard serve` as a real subprocess and talk to it like a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.conftest import free_port


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
        self.env = {**os.environ, **(env or {})}
        self.default_models = default_models
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the process
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> PlatformProcess:
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
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"serve did not come up:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

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


# ----- helpers the tests share -----------------------------------------------------------------


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
