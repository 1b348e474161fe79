"""The hard limits every check of a pushed model file keeps, and the bounded reading the checks
share: exact reads, JSON whose numbers are bounded before any arithmetic, and the child process
that parses a large header or config off the caller's GIL. The checks themselves:
`safetensors_header.py`, `gguf_header.py`, `model_configs.py`; the whole version: `model_files.py`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

from modelyard.core.errors import Invalid


class Reader(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


# ----- the limits (hard: no setting raises them) -------------------------------------------------

MAX_SAFETENSORS_HEADER = 8 << 20  # bytes of one header's JSON (real ones: KiB to a few MiB)
MAX_TENSORS = 65_536  # entries of one header
MAX_NDIM = 8
MAX_DIM = 1 << 40  # every dimension is an int in [0, MAX_DIM)
MAX_CONFIG_BYTES = 1 << 20  # config.json and the other small JSON configs
MAX_INT_DIGITS = 20  # an integer literal in a header or config, before it is converted
MAX_NAME = 256  # a target module, an architecture, a model type


class ModelFileError(Invalid):
    """A pushed file breaks a limit or its format; the message names the file and the limit."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"file {path!r}: {why}", param="files", code="invalid_model_file")
        self.why = why


def read_exact(reader: Reader, n: int, path: str) -> bytes:
    chunks, left = [], n
    while left > 0:
        chunk = reader.read(min(left, 1 << 22))
        if not chunk:
            raise ModelFileError(path, f"ends after {n - left} of the {n} bytes its header needs")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _bounded_int(path: str) -> Callable[[str], int]:
    def parse(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_INT_DIGITS:
            raise ModelFileError(
                path, f"an integer of {len(digits)} digits (limit {MAX_INT_DIGITS} digits)"
            )
        return int(digits)

    return parse


def _finite_float(path: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ModelFileError(path, f"the number {text[:40]} is not finite")
        return value

    return parse


def _no_constant(path: str) -> Callable[[str], Any]:
    def parse(name: str) -> Any:
        raise ModelFileError(path, f"{name} is not a number JSON allows")

    return parse


def bounded_json(raw: bytes, path: str) -> Any:
    """JSON with every integer at most `MAX_INT_DIGITS` digits and every float finite."""
    try:
        return json.loads(
            raw.decode("utf-8"),
            parse_int=_bounded_int(path),
            parse_float=_finite_float(path),
            parse_constant=_no_constant(path),
        )
    except ModelFileError:
        raise
    except RecursionError:
        raise ModelFileError(path, "JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelFileError(path, f"not valid JSON ({str(exc)[:200]})") from None


def is_int(value: Any) -> bool:
    return type(value) is int  # not bool


# ----- large JSON, parsed in a child process ----------------------------------------------------

# Parsing JSON is C code that holds the GIL: a thread parsing a few MiB of it stalls the event
# loop of its process for seconds. A header or config above this is parsed in a child process.
INLINE_JSON = 256 << 10
CHILD_TIMEOUT_S = 120.0
_CHILDREN = threading.BoundedSemaphore(2)  # at most this many such children at once
_CHILD = "modelyard.core.model_file_child"  # what they run


def in_child(check: str, raw: bytes, size: int, path: str) -> int:
    """`check` (`model_file_child.CHECKS`) of `raw` in a fresh interpreter, its verdict back."""
    try:
        with _CHILDREN:
            done = subprocess.run(
                [sys.executable, "-m", _CHILD, check, str(size), path],
                input=raw,
                capture_output=True,
                timeout=CHILD_TIMEOUT_S,
                check=False,
            )
        result = json.loads(done.stdout)
    except (subprocess.TimeoutExpired, ValueError) as exc:
        raise ModelFileError(path, f"its header could not be checked ({exc})") from None
    if "error" in result:
        raise ModelFileError(path, str(result["error"]))
    return int(result["value"])
