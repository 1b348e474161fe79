"""The binary tensor extension's decoding (`protocol/oip_binary.py`) of hostile bodies: every
one is a 400 naming what is wrong, found before any work that grows with a number the body
claims (a shape's element count is the product of its dimensions)."""

from __future__ import annotations

import orjson
import pytest

from modelyard.protocol.oip import MAX_DIMS, OIPError, read_texts
from modelyard.protocol.oip_binary import decode_infer, json_request


def body(shape: list[int], datatype: str, blob: bytes) -> tuple[bytes, str]:
    tensor = {"name": "text", "datatype": datatype, "shape": shape,
              "parameters": {"binary_data_size": len(blob)}}  # fmt: skip
    header = orjson.dumps({"inputs": [tensor]})
    return header + blob, str(len(header))


def element(text: bytes) -> bytes:
    return len(text).to_bytes(4, "little") + text


def test_a_good_body_decodes() -> None:
    raw, length = body([2], "BYTES", element(b"hi") + element(b""))
    decoded = decode_infer(raw, length)
    assert decoded.binary and decoded.request.inputs[0].data == ["hi", ""]


@pytest.mark.parametrize(
    ("shape", "datatype", "blob", "length", "message"),
    [
        # 20,000 dimensions of 2**62: their product took seconds of one C call (the GIL held).
        ([2**62] * 20_000, "BYTES", element(b"x"), None, f"at most {MAX_DIMS} items"),
        ([MAX_DIMS + 1] * (MAX_DIMS + 1), "BYTES", element(b"x"), None, "at most"),
        ([1], "BYTES", (2**31).to_bytes(4, "little") + b"x", None, "runs past"),
        ([1], "BYTES", element(b"a") + element(b"b"), None, "more elements than"),
        ([3], "FP32", b"\x00" * 5, None, "does not fit datatype FP32"),
        ([1], "BYTES", element(b"x"), "-1", "the body holds"),
        ([1], "BYTES", element(b"x"), "1" * 5000, "not an integer"),
        ([1], "BYTES", element(b"x"), str(2**70), "the body holds"),
    ],
)
def test_hostile_bodies_are_400s(
    shape: list[int], datatype: str, blob: bytes, length: str | None, message: str
) -> None:
    raw, header_length = body(shape, datatype, blob)
    with pytest.raises(OIPError) as caught:
        decode_infer(raw, length or header_length)
    assert caught.value.status == 400 and message in caught.value.message, caught.value.message


def test_numeric_binary_data_stays_one_array_and_its_input_is_refused_by_name() -> None:
    """8 MiB of FP32 data: decoded as one array view (not two million
    Python floats), then refused for its datatype as a JSON body would be."""
    raw, length = body([2 * 1024 * 1024], "FP32", b"\x00" * (8 * 1024 * 1024))
    decoded = decode_infer(raw, length)
    data = decoded.request.inputs[0].data
    assert not isinstance(data, list) and len(data) == 2 * 1024 * 1024
    with pytest.raises(OIPError) as caught:
        read_texts(decoded.request, max_inputs=16)
    assert caught.value.status == 400 and "expected BYTES" in caught.value.message
    forwarded = orjson.loads(json_request(decoded.request))
    assert len(forwarded["inputs"][0]["data"]) == 2 * 1024 * 1024
