"""Bounded validation of a model's files as a tenant pushes them, and the size figure kept then.

Every file the platform later parses is checked here, once, with hard limits, before a version
exists: safetensors headers (length, entry count, dtype, rank, each dimension, data offsets that
tile the file), GGUF metadata (`core/gguf_header.py`), `config.json` and the other small JSON
configs (size, an object, the numbers sizing and loading use), `adapter_config.json` (rank,
targets; `core/model_configs.py`). A huge integer is refused from its digits, before any
arithmetic; nothing here does work that is not bounded by these limits. Callers run it in a
thread, never on a loop, and a header or config over `INLINE_JSON` is parsed in a child process
(`in_child`), since parsing JSON holds the GIL and would stall the caller's event loop.

What it returns (`ModelFacts.param_count`) is recorded on the version's row, so that sizing a
replica or an encoder never reads a header again.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from modelyard.core.errors import Invalid


class Reader(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


# ----- the limits (hard: no setting raises them) -------------------------------------------------

MAX_FILES = 10_000  # files in one version
MAX_SAFETENSORS_HEADER = 8 << 20  # bytes of one header's JSON (real ones: KiB to a few MiB)
MAX_TOTAL_HEADER = 256 << 20  # bytes of every header of one version together
MAX_TENSORS = 65_536  # entries of one header
MAX_NDIM = 8
MAX_DIM = 1 << 40  # every dimension is an int in [0, MAX_DIM)
MAX_CONFIG_BYTES = 1 << 20  # config.json and the other small JSON configs
MAX_INT_DIGITS = 20  # an integer literal in a header or config, before it is converted
MAX_NAME = 256  # a target module, an architecture, a model type
# Bytes per element of the safetensors dtypes the engine and encoders load.
SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
CONFIG_NAMES = frozenset(
    {
        "config.json",
        "adapter_config.json",
        "modules.json",
        "sentence_bert_config.json",
        "config_sentence_transformers.json",
        "generation_config.json",
    }
)
# A GGUF file's parameters, estimated from its size at ~4.5 bits a weight (its common Q4 types).
GGUF_BITS_PER_WEIGHT = 4.5


class ModelFileError(Invalid):
    """A pushed file breaks a limit or its format; the message names the file and the limit."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"file {path!r}: {why}", param="files", code="invalid_model_file")
        self.why = why


@dataclass(frozen=True)
class ModelFacts:
    param_count: int  # what sizing multiplies by the weights' dtype width


# ----- one file ------------------------------------------------------------------------------


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
    return _header_numel(raw, data_len, path), length


def _header_numel(raw: bytes, data_len: int, path: str) -> int:
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


# ----- large JSON, parsed in a child process ----------------------------------------------------

# Parsing JSON is C code that holds the GIL: a thread parsing a few MiB of it stalls the event
# loop of its process for seconds. A header or config above this is parsed in a child process.
INLINE_JSON = 256 << 10
CHILD_TIMEOUT_S = 120.0
_CHILDREN = threading.BoundedSemaphore(2)  # at most this many such children at once
_CHECKS: dict[str, Callable[[bytes, int, str], int]] = {
    "safetensors": _header_numel,
    "config": lambda raw, _size, path: _config_bytes(raw, path),
}


def _config_bytes(raw: bytes, path: str) -> int:
    from modelyard.core.model_configs import check_config_bytes

    check_config_bytes(raw, path)
    return 0


def in_child(check: str, raw: bytes, size: int, path: str) -> int:
    """`_CHECKS[check](raw, size, path)` in a fresh interpreter (`python -m` this module)."""
    try:
        with _CHILDREN:
            done = subprocess.run(
                [sys.executable, "-m", __name__, check, str(size), path],
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


def _child_main(argv: list[str]) -> None:
    check, size, path = argv
    try:
        result: dict[str, Any] = {"value": _CHECKS[check](sys.stdin.buffer.read(), int(size), path)}
    except ModelFileError as exc:
        result = {"error": exc.why}
    sys.stdout.write(json.dumps(result))


# ----- a whole version ----------------------------------------------------------------------


def param_count(sizes: Mapping[str, int], numels: Mapping[str, int]) -> int:
    """What sizing multiplies by the dtype width: the exact count of the top-level safetensors
    (or, when there are none there, of every safetensors file: a sentence-transformers model
    in a subfolder); a GGUF file's estimated from its size; else pytorch `.bin` files, most
    stored in 16 bits."""
    top = [n for p, n in numels.items() if "/" not in p]
    if top:
        return sum(top)
    if numels:
        return sum(numels.values())
    ggufs = [s for p, s in sizes.items() if p.endswith(".gguf")]
    if ggufs:
        return sum(int(s * 8 / GGUF_BITS_PER_WEIGHT) for s in ggufs)
    bins = [s for p, s in sizes.items() if "/" not in p and p.startswith("pytorch_model")]
    return sum(s // 2 for s in bins)


def inspect_files(sizes: Mapping[str, int], open_file: Callable[[str], Reader]) -> ModelFacts:
    """Check every file of a version (relative path → size) that anything parses later, and
    return its size figure; `ModelFileError` names the first file that breaks a limit."""
    from modelyard.core.gguf_header import check_gguf
    from modelyard.core.model_configs import check_config

    if len(sizes) > MAX_FILES:
        raise Invalid(f"{len(sizes)} files (limit {MAX_FILES})", param="files", code="too_many")
    numels: dict[str, int] = {}
    headers = 0
    for path, size in sorted(sizes.items()):
        name = PurePosixPath(path).name
        if not (name.endswith((".safetensors", ".gguf")) or name in CONFIG_NAMES):
            continue
        with _opened(open_file, path) as reader:
            if name.endswith(".safetensors"):
                numels[path], length = safetensors_numel(reader, size, path)
                headers += length
                if headers > MAX_TOTAL_HEADER:
                    raise ModelFileError(
                        path, f"the version's headers pass {MAX_TOTAL_HEADER} bytes in all"
                    )
            elif name.endswith(".gguf"):
                check_gguf(reader, size, path)
            else:
                check_config(reader, size, path)
    return ModelFacts(param_count(sizes, numels))


@contextmanager
def _opened(open_file: Callable[[str], Reader], path: str) -> Iterator[Reader]:
    reader = open_file(path)
    try:
        yield reader
    finally:
        reader.close()


def inspect_local(source: Path) -> ModelFacts:
    """The same for a folder (or a single `.gguf` file) on this node."""
    if source.is_file():
        files = {source.name: source}
    else:
        files = {
            p.relative_to(source).as_posix(): p for p in sorted(source.rglob("*")) if p.is_file()
        }
        if len(files) > MAX_FILES:
            raise Invalid(f"{len(files)} files (limit {MAX_FILES})", code="too_many")
    sizes = {rel: p.stat().st_size for rel, p in files.items()}
    return inspect_files(sizes, lambda rel: files[rel].open("rb"))


if __name__ == "__main__":  # the child of `in_child`: run as the package's module, not __main__
    from modelyard.core import model_files

    model_files._child_main(sys.argv[1:])
