"""Bounded check of a safetensors file's header at push: its length, entry count, each tensor's
dtype, rank and dimensions, and data offsets that tile the data section exactly (as the loader
requires); a header over `INLINE_JSON` is parsed in a child process (`in_child`)."""

from __future__ import annotations

import math
import struct
from typing import Any

from modelyard.core.model_file_limits import (
    INLINE_JSON,
    MAX_DIM,
    MAX_NAME,
    MAX_NDIM,
    MAX_SAFETENSORS_HEADER,
    MAX_TENSORS,
    ModelFileError,
    Reader,
    bounded_json,
    in_child,
    is_int,
    read_exact,
)

# Bytes per element of the safetensors dtypes the engine and encoders load.
SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


def safetensors_numel(reader: Reader, size: int, path: str) -> tuple[int, int]:
    """(elements, header bytes) of a safetensors file, its header checked against every limit;
    the data offsets must tile the data section exactly, as the loader requires."""
    if size < 8:
        raise ModelFileError(path, "too short for a safetensors header")
    (length,) = struct.unpack("<Q", read_exact(reader, 8, path))
    if length > MAX_SAFETENSORS_HEADER:
        raise ModelFileError(
            path, f"safetensors header of {length} bytes (limit {MAX_SAFETENSORS_HEADER})"
        )
    if 8 + length > size:
        raise ModelFileError(path, f"safetensors header of {length} bytes overruns the file")
    raw = read_exact(reader, length, path)
    data_len = size - 8 - length
    if length > INLINE_JSON:
        return in_child("safetensors", raw, data_len, path), length
    return header_numel(raw, data_len, path), length


def header_numel(raw: bytes, data_len: int, path: str) -> int:
    header = bounded_json(raw, path)
    if not isinstance(header, dict):
        raise ModelFileError(path, "safetensors header is not a JSON object")
    tensors = len(header) - ("__metadata__" in header)
    if tensors > MAX_TENSORS:
        raise ModelFileError(path, f"{tensors} tensors in its header (limit {MAX_TENSORS})")
    spans: list[tuple[int, int, str]] = []
    numel = 0
    for name, entry in header.items():
        if name == "__metadata__":
            ok = isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())
            if not ok:
                raise ModelFileError(path, "__metadata__ must map names to strings")
            continue
        n, span = _tensor(entry, name[:MAX_NAME], data_len, path)
        numel += n
        spans.append((*span, name[:MAX_NAME]))
    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise ModelFileError(path, f"tensor {name!r} does not start where the previous ends")
        end = stop
    if end != data_len:
        raise ModelFileError(path, f"the tensors cover {end} of the {data_len} data bytes")
    return numel


def _tensor(entry: Any, name: str, data_len: int, path: str) -> tuple[int, tuple[int, int]]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ModelFileError(path, f"tensor {name!r}: needs exactly dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in SAFETENSORS_DTYPES:
        known = ", ".join(SAFETENSORS_DTYPES)
        raise ModelFileError(path, f"tensor {name!r}: dtype {str(dtype)[:40]!r} (one of {known})")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ModelFileError(path, f"tensor {name!r}: shape must be a list of ≤ {MAX_NDIM} dims")
    # Each dimension is compared before anything multiplies it.
    if not all(is_int(d) and 0 <= d < MAX_DIM for d in shape):
        raise ModelFileError(path, f"tensor {name!r}: each dimension must be an int in [0, 2**40)")
    ok = isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)
    if not ok or not 0 <= offsets[0] <= offsets[1] <= data_len:
        raise ModelFileError(
            path, f"tensor {name!r}: data_offsets must be [begin, end] within the file"
        )
    numel = math.prod(shape)  # ≤ 8 factors under 2**40: a small product
    if numel * SAFETENSORS_DTYPES[dtype] != offsets[1] - offsets[0]:
        raise ModelFileError(
            path, f"tensor {name!r}: shape × dtype size does not match its data_offsets"
        )
    return numel, (offsets[0], offsets[1])
