"""Model files for the hostile-input tests: the safetensors header of issue 27 and the exact
element count of a folder's weights, as the safetensors library reads them."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

HUGE = "9" * 4300  # the digits of one dimension in the hostile header of issue 27


def safetensors_bytes(header: dict[str, Any] | list[Any] | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def hostile_safetensors() -> bytes:
    """~2.5 MB: 600 dimensions of 4,300 digits each, which the unbounded sizing multiplied."""
    dims = ", ".join([HUGE] * 600)
    header = f'{{"w": {{"dtype": "F32", "shape": [{dims}], "data_offsets": [0, 4]}}}}'
    return safetensors_bytes(header.encode(), b"\0" * 4)


def exact_numel(folder: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for p in folder.glob("*.safetensors") for t in load_file(p).values())
