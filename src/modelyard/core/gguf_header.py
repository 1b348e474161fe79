"""Bounded check of a GGUF file's header (metadata key-values and tensor infos) at push.

The engine converts a GGUF file with the `gguf` package's reader (`engine/models/gguf_convert`),
which trusts every count and length it reads. This walks the same layout first, with hard
limits: counts of keys and tensors, string and array lengths, no nested arrays, known value and
tensor types, at most four dimensions under 2**40 each, tensor offsets inside the file, and at
most `MAX_METADATA_BYTES` read in all. Fixed-width arrays are skipped by arithmetic, not looped.
"""

from __future__ import annotations

import struct

from modelyard.core.model_file_limits import MAX_DIM, ModelFileError, Reader

MAX_METADATA_BYTES = 64 << 20  # key-values and tensor infos together (a 256k vocab: ~15 MiB)
MAX_KV = 4096
MAX_TENSORS = 65_536
MAX_STRING = 4 << 20
MAX_KEY = 1024
MAX_ARRAY = 1 << 21  # elements of one array (vocab and merges of the largest tokenizers)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_TYPE = 64  # ggml types are numbered below this
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type → bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _Stream:
    """Sequential reads of at most `MAX_METADATA_BYTES`, from a buffer refilled in chunks."""

    def __init__(self, reader: Reader, path: str) -> None:
        self.reader, self.path = reader, path
        self.buf = b""
        self.pos = 0  # in buf
        self.consumed = 0  # bytes of the file before buf

    @property
    def offset(self) -> int:
        return self.consumed + self.pos

    def take(self, n: int) -> bytes:
        if self.offset + n > MAX_METADATA_BYTES:
            raise ModelFileError(
                self.path, f"GGUF metadata passes {MAX_METADATA_BYTES} bytes (the limit)"
            )
        while len(self.buf) - self.pos < n:
            chunk = self.reader.read(max(1 << 20, n))
            if not chunk:
                raise ModelFileError(self.path, "GGUF metadata ends before the file says")
            self.consumed += self.pos
            self.buf = self.buf[self.pos :] + chunk
            self.pos = 0
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def string(self, limit: int, what: str) -> bytes:
        n = self.u64()
        if n > limit:
            raise ModelFileError(self.path, f"GGUF {what} of {n} bytes (limit {limit})")
        return self.take(n)


def check_gguf(reader: Reader, size: int, path: str) -> None:
    s = _Stream(reader, path)
    if s.take(4) != b"GGUF":
        raise ModelFileError(path, "not a GGUF file (no GGUF magic)")
    version = s.u32()
    if version not in (2, 3):
        raise ModelFileError(path, f"GGUF version {version} (2 or 3 are read)")
    tensors, kvs = s.u64(), s.u64()
    if kvs > MAX_KV:
        raise ModelFileError(path, f"{kvs} GGUF metadata keys (limit {MAX_KV})")
    if tensors > MAX_TENSORS:
        raise ModelFileError(path, f"{tensors} GGUF tensors (limit {MAX_TENSORS})")
    alignment = 32
    for _ in range(kvs):
        key = s.string(MAX_KEY, "key")
        kind = s.u32()
        if key == b"general.alignment" and kind == _UINT32:
            alignment = s.u32()
            if alignment == 0 or alignment & (alignment - 1) or alignment > 1 << 16:
                raise ModelFileError(path, "general.alignment must be a power of two ≤ 65536")
            continue
        _skip_value(s, kind, key)
    offsets = []
    for _ in range(tensors):
        s.string(MAX_KEY, "tensor name")
        dims = s.u32()
        if dims > MAX_DIMS:
            raise ModelFileError(path, f"a GGUF tensor of {dims} dimensions (limit {MAX_DIMS})")
        if any(s.u64() >= MAX_DIM for _ in range(dims)):
            raise ModelFileError(path, "a GGUF tensor dimension is not under 2**40")
        if s.u32() >= MAX_TENSOR_TYPE:
            raise ModelFileError(path, "a GGUF tensor of an unknown type")
        offsets.append(s.u64())
    data_start = -(-s.offset // alignment) * alignment
    if data_start + max(offsets, default=0) > size:
        raise ModelFileError(path, "a GGUF tensor's offset lies past the end of the file")


_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


TOKENS_COUNT = "tokenizer.ggml.tokens.count"  # gguf_ints' key for the vocabulary's size


def gguf_ints(reader: Reader, path: str) -> dict[str, int]:
    """The integer metadata of a GGUF file (`llama.embedding_length`, …), and the length of its
    token list as `TOKENS_COUNT`, read within the same limits as `check_gguf` (a file pushed
    already passed it)."""
    s = _Stream(reader, path)
    if s.take(4) != b"GGUF" or s.u32() not in (2, 3):
        raise ModelFileError(path, "not a GGUF file of version 2 or 3")
    s.u64()
    kvs = s.u64()
    if kvs > MAX_KV:
        raise ModelFileError(path, f"{kvs} GGUF metadata keys (limit {MAX_KV})")
    out: dict[str, int] = {}
    for _ in range(kvs):
        key = s.string(MAX_KEY, "key")
        kind = s.u32()
        if kind in _INTS:
            fmt = _INTS[kind]
            out[key.decode("utf-8", "replace")] = int(
                struct.unpack(fmt, s.take(struct.calcsize(fmt)))[0]
            )
        elif kind == _ARRAY:
            inner, count = s.u32(), s.u64()
            if key == b"tokenizer.ggml.tokens":
                out[TOKENS_COUNT] = count
            _skip_array(s, inner, count, key)
        else:
            _skip_value(s, kind, key)
    return out


def _skip_value(s: _Stream, kind: int, key: bytes) -> None:
    name = key[:80].decode("utf-8", "replace")
    if kind in _FIXED:
        s.take(_FIXED[kind])
    elif kind == _STRING:
        s.string(MAX_STRING, f"string {name!r}")
    elif kind == _ARRAY:
        _skip_array(s, s.u32(), s.u64(), key)
    else:
        raise ModelFileError(s.path, f"GGUF key {name!r} has unknown value type {kind}")


def _skip_array(s: _Stream, inner: int, count: int, key: bytes) -> None:
    name = key[:80].decode("utf-8", "replace")
    if count > MAX_ARRAY:
        raise ModelFileError(s.path, f"GGUF array {name!r} of {count} items (limit {MAX_ARRAY})")
    if inner in _FIXED:
        s.take(_FIXED[inner] * count)
    elif inner == _STRING:
        for _ in range(count):
            s.string(MAX_STRING, f"string in {name!r}")
    else:
        raise ModelFileError(s.path, f"GGUF array {name!r} of type {inner} (no nested arrays)")
