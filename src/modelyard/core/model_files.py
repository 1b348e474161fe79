"""Bounded validation of a model's files as a tenant pushes them, and the size figure kept then.

Every file the platform later parses is checked here, once, with hard limits, before a version
exists: safetensors headers (length, entry count, dtype, rank, each dimension, data offsets that
tile the file; `core/safetensors_header.py`), GGUF metadata (`core/gguf_header.py`),
`config.json` and the other small JSON configs (size, an object, the numbers sizing and loading
use), `adapter_config.json` (rank, targets; `core/model_configs.py`). A huge integer is refused
from its digits, before any arithmetic; nothing here does work that is not bounded by these
limits. Callers run it in a thread, never on a loop, and a header or config over `INLINE_JSON`
is parsed in a child process (`in_child`), since parsing JSON holds the GIL and would stall the
caller's event loop. The limits and the bounded reading the checks share are in
`core/model_file_limits.py`.

What it returns (`ModelFacts.param_count`) is recorded on the version's row, so that sizing a
replica or an encoder never reads a header again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from modelyard.core.errors import Invalid
from modelyard.core.gguf_header import check_gguf
from modelyard.core.model_configs import check_config
from modelyard.core.model_file_limits import ModelFileError, Reader
from modelyard.core.safetensors_header import safetensors_numel

MAX_FILES = 10_000  # files in one version
MAX_TOTAL_HEADER = 256 << 20  # bytes of every header of one version together
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


@dataclass(frozen=True)
class ModelFacts:
    param_count: int  # what sizing multiplies by the weights' dtype width


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
