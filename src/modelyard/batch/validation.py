"""Checking a batch input file line by line (OpenAI's JSONL request format).

Each line must be `{"custom_id": str, "method": "POST", "url": <the batch's endpoint>,
"body": {...}}` with a custom_id unique in the file. A bad line becomes an error record of its
own and never fails the others; a file with no good line (or not JSONL at all, or too many
lines) fails the whole batch.

Lines are bounded: a batch upload is copied in chunks and refused at the first line over
`max_line_bytes` (`copy_batch_upload`), and reading a file never holds more than one line of that
bound in memory (a longer one, in a file stored before the bound or uploaded for another
purpose, becomes its own error record, skipped in chunks).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from modelyard.core.errors import Invalid, TooLarge
from modelyard.protocol.json_depth import too_deep

MAX_LINES = 50_000
MAX_CUSTOM_ID = 500
_CHUNK = 1 << 20
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


def copy_batch_upload(
    source: IO[bytes], out: IO[bytes], max_line_bytes: int, max_file_bytes: int
) -> int:
    """Copy a batch input upload in chunks, refusing it at the first line longer than
    `max_line_bytes` or once it passes `max_file_bytes`; returns its size. Nothing holds more
    than one chunk."""
    size = line = 0
    number = 1
    while chunk := source.read(_CHUNK):
        size += len(chunk)
        if size > max_file_bytes:
            raise TooLarge(
                f"a batch input file holds at most {max_file_bytes} bytes",
                param="file",
                code="file_too_large",
            )
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            line += (len(chunk) if end < 0 else end) - start
            if line > max_line_bytes:
                raise Invalid(
                    f"line {number} of the batch input file is over the limit of "
                    f"{max_line_bytes} bytes a line",
                    param="file",
                    code="line_too_large",
                )
            if end < 0:
                break
            line, number, start = 0, number + 1, end + 1
        out.write(chunk)
    return size


def _lines(f: IO[bytes], max_line_bytes: int) -> Iterator[tuple[bytes, bool]]:
    """Each line of `f` and whether it is within the bound; the rest of a longer one is read
    and dropped in chunks."""
    while raw := f.readline(max_line_bytes + 1):
        if len(raw) <= max_line_bytes or (raw.endswith(b"\n") and len(raw) == max_line_bytes + 1):
            yield raw, True
            continue
        while (rest := f.readline(_CHUNK)) and not rest.endswith(b"\n"):
            pass
        yield b"", False


def validate_file(
    path: Path, endpoint: str, max_line_bytes: int = 1 << 20, max_file_bytes: int = 100 << 20
) -> tuple[list[GoodLine], list[BadLine]]:
    if path.stat().st_size > max_file_bytes:
        raise BatchFileInvalid(
            [{"code": "file_too_large", "line": None, "param": None,
              "message": f"a batch input file holds at most {max_file_bytes} bytes"}]
        )  # fmt: skip
    good: list[GoodLine] = []
    bad: list[BadLine] = []
    seen: set[str] = set()
    n = 0
    with open(path, "rb") as f:
        for n, (raw, within) in enumerate(_lines(f, max_line_bytes), start=1):
            if n > MAX_LINES:
                raise BatchFileInvalid(
                    [{"code": "too_many_requests", "line": None, "param": None,
                      "message": f"a batch holds at most {MAX_LINES} requests"}]
                )  # fmt: skip
            if not within:
                message = f"the line is over the limit of {max_line_bytes} bytes"
                bad.append(BadLine(n, None, "line_too_large", message))
                continue
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
