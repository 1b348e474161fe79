"""A small HTTP client for the platform's API (httpx): one place that turns an error answer
into `ApiError` carrying the API's own message, so commands print it instead of a traceback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx

from modelyard.cli_commands.profiles import Target


class ApiError(RuntimeError):
    """The platform refused a request (`status` is its HTTP status) or could not be reached
    (`status` 0); `str()` is the API's message."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def error_from(response: httpx.Response) -> ApiError:
    try:
        error = response.json()["error"]
        return ApiError(response.status_code, str(error["message"]), error.get("code"))
    except (ValueError, KeyError, TypeError):
        text = response.text.strip()[:300] or response.reason_phrase
        return ApiError(response.status_code, f"HTTP {response.status_code}: {text}")


class PlatformClient:
    def __init__(self, target: Target, timeout: float = 60.0) -> None:
        self.target = target
        headers = {"authorization": f"Bearer {target.api_key}"} if target.api_key else {}
        self.http = httpx.Client(base_url=target.url, headers=headers, timeout=timeout)

    def __enter__(self) -> PlatformClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if not self.target.api_key:
            raise ApiError(
                0,
                "no API key: run `modelyard login`, set MODELYARD_API_KEY or pass --api-key",
            )
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach {self.target.url}: {exc}") from exc
        if response.status_code >= 400:
            raise error_from(response)
        return response

    def get(self, path: str, **params: Any) -> Any:
        clean = {k: v for k, v in params.items() if v is not None}
        return self.request("GET", path, params=clean).json()

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self.request("POST", path, json=body or {}).json()

    def put(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("PUT", path, json=body).json()

    def patch(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("PATCH", path, json=body).json()

    def delete(self, path: str) -> Any:
        response = self.request("DELETE", path)
        return response.json() if response.content else {}

    def text(self, path: str, **params: Any) -> str:
        clean = {k: v for k, v in params.items() if v is not None}
        return self.request("GET", path, params=clean).text

    def download(self, path: str, out: IO[bytes]) -> int:
        """Stream a body into `out`; the byte count."""
        written = 0
        try:
            with self.http.stream("GET", path) as response:
                if response.status_code >= 400:
                    response.read()
                    raise error_from(response)
                for block in response.iter_bytes():
                    out.write(block)
                    written += len(block)
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach {self.target.url}: {exc}") from exc
        return written

    def upload(self, path: Path, purpose: str, reader: IO[bytes]) -> Any:
        files = {"file": (path.name, reader, "application/jsonl")}
        return self.request("POST", "/v1/files", data={"purpose": purpose}, files=files).json()

    def stream_chat(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed chat completion, as they arrive (Server-Sent Events)."""
        if not self.target.api_key:
            raise ApiError(0, "no API key: run `modelyard login` or set MODELYARD_API_KEY")
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise error_from(response)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:  # an error after the stream began
                        raise ApiError(500, str(chunk["error"].get("message", chunk["error"])))
                    yield chunk
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach {self.target.url}: {exc}") from exc
