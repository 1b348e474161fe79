"""What the budgets' platform tests share: a webhook receiver, and a tenant with its admin API
and an inference key (`test_budgets.py`)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Any

import httpx

from tests.platform_harness import PlatformProcess, create_key

MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]


class Hook(http.server.ThreadingHTTPServer):
    """A webhook receiver on 127.0.0.1 recording what it gets."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], dict[str, Any]]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                outer.received.append((headers, json.loads(body)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"


class Tenant:
    def __init__(self, platform: PlatformProcess, admin: httpx.Client, **settings: Any) -> None:
        r = admin.post("/v1/tenants", json={"name": f"t-{time.time_ns()}", **settings})
        assert r.status_code == 201, r.text
        self.id = str(r.json()["id"])
        self.platform = platform
        self.admin_key = create_key(admin, self.id, scopes=["admin", "inference"])["key"]
        self.api = platform.api(self.admin_key)
        self.key = create_key(admin, self.id, scopes=["inference"])

    def budget(self, **body: Any) -> dict[str, Any]:
        r = self.api.post("/v1/budgets", json=body)
        assert r.status_code == 201, r.text
        return dict(r.json())

    def chat(self, max_tokens: int, model: str = "tiny", **extra: Any) -> httpx.Response:
        body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens,
                "ignore_eos": True, **extra}  # fmt: skip
        with self.platform.api(self.key["key"]) as http:
            return http.post("/v1/chat/completions", json=body)

    def stream(self, max_tokens: int) -> tuple[int, str]:
        """A whole stream: its status and the error code or request id."""
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{self.platform.url}/v1/chat/completions", json=body,
                          headers={"authorization": f"Bearer {self.key['key']}"},
                          timeout=60) as r:  # fmt: skip
            if r.status_code != 200:
                return r.status_code, json.loads(r.read())["error"]["code"]
            for _ in r.iter_lines():
                pass
            return 200, r.headers["x-request-id"]
