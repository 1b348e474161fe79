"""The Open Inference Protocol's binary tensor data extension (what `tritonclient` sends and asks
for by default): a body that is a JSON header of `Inference-Header-Content-Length` bytes followed
by the raw bytes of the inputs whose `parameters.binary_data_size` say so, in input order; and
answers whose outputs are sent the same way when the request asks (`parameters.binary_data_output`
for all outputs, or an output's own `parameters.binary_data`).

A BYTES tensor's raw form is each element as a 4-byte little-endian length and its bytes; numeric
tensors are their little-endian values, row-major. Everything read is bounded by the body (itself
bounded at the edge): sizes that do not add up to it exactly are refused, never guessed around.
Callers run these functions off the event loop: a body may be megabytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from starlette.responses import Response

from modelyard.protocol.oip import InferRequest, OIPError, parse_infer_request

HEADER = "inference-header-content-length"
EXTENSIONS = ["binary_tensor_data"]  # what `GET /v2` lists
_LENGTH = struct.Struct("<I")
# Numeric output datatypes and the little-endian numpy type of their raw form.
_NUMPY = {"FP32": "<f4", "FP64": "<f8", "INT64": "<i8", "INT32": "<i4"}


@dataclass
class DecodedInfer:
    request: InferRequest  # binary inputs' data filled in as JSON's would be
    binary: bool  # the body carried binary inputs


def decode_infer(raw: bytes, header_length: str | None) -> DecodedInfer:
    """The request of a JSON or binary-extension body (`header_length`: the header's value)."""
    if header_length is None:
        return DecodedInfer(parse_infer_request(raw), False)
    try:
        size = int(header_length)
    except ValueError:
        raise OIPError(400, "header 'Inference-Header-Content-Length' is not an integer") from None
    if not 0 < size <= len(raw):
        raise OIPError(
            400,
            f"header 'Inference-Header-Content-Length' is {size}; the body holds {len(raw)} bytes",
        )
    request = parse_infer_request(raw[:size])
    _attach(request, memoryview(raw)[size:])
    return DecodedInfer(request, True)


def _attach(request: InferRequest, blob: memoryview) -> None:
    offset = 0
    for tensor in request.inputs:
        size = (tensor.parameters or {}).get("binary_data_size")
        if size is None:
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise OIPError(400, f"input '{tensor.name}': 'binary_data_size' must be an integer")
        if tensor.data is not None:
            raise OIPError(400, f"input '{tensor.name}' has both 'data' and 'binary_data_size'")
        if offset + size > len(blob):
            raise OIPError(
                400,
                f"input '{tensor.name}': 'binary_data_size' {size} runs past the body's "
                f"{len(blob) - offset} remaining bytes",
            )
        chunk = blob[offset : offset + size]
        tensor.data = _decode(tensor.name, tensor.datatype, tensor.shape, chunk)
        offset += size
    if offset != len(blob):
        raise OIPError(
            400, f"the body holds {len(blob) - offset} bytes no input's 'binary_data_size' claims"
        )


def _decode(name: str, datatype: str, shape: list[int], chunk: memoryview) -> Any:
    if datatype != "BYTES":
        dtype = _NUMPY.get(datatype)
        if dtype is None or len(chunk) % np.dtype(dtype).itemsize:
            raise OIPError(400, f"input '{name}': binary data does not fit datatype {datatype}")
        # A view, not a list: no model here takes numeric inputs, and megabytes of floats would
        # become millions of Python objects before `read_texts` refuses the input's name/type.
        return np.frombuffer(chunk, dtype=dtype)
    # No more elements than the shape says: a body of empty elements cannot make a huge list.
    expected = math.prod(shape) if all(d >= 0 for d in shape) else 0
    out: list[Any] = []
    offset = 0
    while offset < len(chunk):
        if len(out) >= expected:
            raise OIPError(400, f"input '{name}': binary data holds more elements than {shape}")
        if offset + 4 > len(chunk):
            raise OIPError(400, f"input '{name}': binary data ends inside an element's length")
        (n,) = _LENGTH.unpack_from(chunk, offset)
        offset += 4
        if offset + n > len(chunk):
            raise OIPError(400, f"input '{name}': element {len(out)} runs past its binary data")
        try:
            out.append(bytes(chunk[offset : offset + n]).decode("utf-8"))
        except UnicodeDecodeError:
            raise OIPError(400, f"input '{name}': element {len(out)} is not UTF-8 text") from None
        offset += n
    return out


def binary_outputs(request: InferRequest, names: list[str]) -> list[str]:
    """Which of the answer's outputs go as binary data: an output's own `binary_data`
    parameter, else the request's `binary_data_output` (False unless asked)."""
    default = (request.parameters or {}).get("binary_data_output") is True
    own = {o.name: (o.parameters or {}).get("binary_data") for o in request.outputs or []}
    return [n for n in names if (own.get(n) if isinstance(own.get(n), bool) else default)]


def json_request(request: InferRequest) -> bytes:
    """The request as a plain JSON body asking for JSON outputs (what the gateway forwards once
    it has read a binary body: the worker's answer is turned binary at the edge)."""
    body = request.model_dump(exclude_none=True)
    for tensor in body["inputs"]:
        (tensor.get("parameters") or {}).pop("binary_data_size", None)
    for output in body.get("outputs") or []:
        (output.get("parameters") or {}).pop("binary_data", None)
    (body.get("parameters") or {}).pop("binary_data_output", None)
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _raw(output: dict[str, Any]) -> bytes:
    data = output["data"]
    if output["datatype"] == "BYTES":
        parts = [str(x).encode("utf-8") for x in data]
        return b"".join(_LENGTH.pack(len(p)) + p for p in parts)
    dtype = _NUMPY.get(output["datatype"], "<f4")
    return bytes(np.ascontiguousarray(np.asarray(data, dtype=dtype)).reshape(-1).tobytes())


def encode_answer(body: dict[str, Any], binary: list[str]) -> tuple[bytes, int]:
    """The answer with the outputs named in `binary` as raw data after the JSON header; the
    header's length (for `Inference-Header-Content-Length`)."""
    blobs = []
    for output in body.get("outputs") or []:
        if output.get("name") in binary:
            raw = _raw(output)
            del output["data"]
            parameters = output.get("parameters") or {}
            output["parameters"] = {**parameters, "binary_data_size": len(raw)}
            blobs.append(raw)
    header = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return header + b"".join(blobs), len(header)


def answer_response(content: bytes, header_length: int | None, headers: dict[str, str]) -> Response:
    """An infer answer: plain JSON, or the binary form with its header length."""
    if header_length is None:
        return Response(content, media_type="application/json", headers=headers)
    headers = {**headers, HEADER: str(header_length)}
    return Response(content, media_type="application/octet-stream", headers=headers)
