"""Checking a batch input file line by line (OpenAI's JSONL request format).

Each line must be `{"custom_id": str, "method": "POST", "url": <the batch's endpoint>,
"body": {...}}` with a custom_id unique in the file. A bad line becomes an error record of its
own and never fails the others; a file with no good line (or not JSONL at all, or too many
lines) fails the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from modelyard.protocol.json_depth import too_deep

MAX_LINES = 50_000
MAX_CUSTOM_ID = 500
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@dataclass
class GoodLine:
    line: int  # 1-based
    custom_id: str
    body: dict[str, Any]


@dataclass
class BadLine:
    line: int
    custom_id: str | None
    code: str
    message: str

    def error(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": None, "line": self.line}


class BatchFileInvalid(ValueError):
    """The whole file is unusable; `errors` lists why (OpenAI's `errors.data`)."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors[0]["message"] if errors else "invalid batch file")
        self.errors = errors


def _check(obj: Any, line: int, endpoint: str, seen: set[str]) -> GoodLine | BadLine:
    if not isinstance(obj, dict):
        return BadLine(line, None, "invalid_json_line", "each line must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(line, None, "missing_custom_id", "custom_id must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID:
        return BadLine(line, None, "invalid_custom_id", f"custom_id is over {MAX_CUSTOM_ID} chars")
    if custom_id in seen:
        return BadLine(
            line, custom_id, "duplicate_custom_id", f"custom_id {custom_id!r} appears twice"
        )
    seen.add(custom_id)
    if obj.get("method") != "POST":
        return BadLine(line, custom_id, "invalid_method", "method must be POST")
    if obj.get("url") != endpoint:
        return BadLine(
            line, custom_id, "mismatched_url",
            f"url {obj.get('url')!r} does not match the batch's endpoint {endpoint!r}",
        )  # fmt: skip
    body = obj.get("body")
    if not isinstance(body, dict):
        return BadLine(line, custom_id, "invalid_body", "body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        return BadLine(line, custom_id, "missing_model", "body.model must be a non-empty string")
    if body.get("stream"):
        return BadLine(line, custom_id, "stream_not_allowed", "batch requests cannot stream")
    return GoodLine(line, custom_id, body)


def validate_file(path: Path, endpoint: str) -> tuple[list[GoodLine], list[BadLine]]:
    good: list[GoodLine] = []
    bad: list[BadLine] = []
    seen: set[str] = set()
    n = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if n > MAX_LINES:
                raise BatchFileInvalid(
                    [{"code": "too_many_requests", "line": None, "param": None,
                      "message": f"a batch holds at most {MAX_LINES} requests"}]
                )  # fmt: skip
            if not raw.strip():
                continue
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                bad.append(BadLine(n, None, "invalid_json_line", f"not valid JSON: {exc}"))
                continue
            deep = too_deep(raw)
            if deep is not None:
                bad.append(BadLine(n, None, "json_too_deep", deep))
                continue
            result = _check(obj, n, endpoint, seen)
            (good if isinstance(result, GoodLine) else bad).append(result)  # type: ignore[arg-type]
    if not good:
        errors = [b.error() for b in bad[:100]] or [
            {"code": "empty_file", "message": "the input file has no requests", "param": None,
             "line": None}
        ]  # fmt: skip
        raise BatchFileInvalid(errors)
    return good, bad
