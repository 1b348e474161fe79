"""The child process of `model_file_limits.in_child`: one check of a large safetensors header or
JSON config, its bytes on stdin, its verdict as one JSON object on stdout (`{"value": n}` or
`{"error": why}`), so that parsing them never holds the GIL of a process with an event loop."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from modelyard.core.model_configs import check_config_bytes
from modelyard.core.model_file_limits import ModelFileError
from modelyard.core.safetensors_header import header_numel

CHECKS: dict[str, Callable[[bytes, int, str], int]] = {
    "safetensors": header_numel,
    "config": lambda raw, _size, path: _config_bytes(raw, path),
}


def _config_bytes(raw: bytes, path: str) -> int:
    check_config_bytes(raw, path)
    return 0


def main(argv: list[str]) -> None:
    check, size, path = argv
    try:
        result: dict[str, Any] = {"value": CHECKS[check](sys.stdin.buffer.read(), int(size), path)}
    except ModelFileError as exc:
        result = {"error": exc.why}
    sys.stdout.write(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
