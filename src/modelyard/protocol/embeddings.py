"""OpenAI's `/v1/embeddings` at the HTTP edge: the request schema, its input limits, and the
response body (float lists, or base64 of little-endian float32 as the official client decodes).

Every field OpenAI defines is honoured (`dimensions` truncates Matryoshka-style where the model
allows it, else a 400 naming it); `user` is accepted and, as at OpenAI, changes nothing; any
other argument gets OpenAI's 400 "Unrecognized request argument supplied".
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import Field, StrictInt, StrictStr, field_validator

from modelyard.protocol.bounds import MAX_TEXT_CHARS, Name, at_most, check_token_ids
from modelyard.protocol.errors import bad_request
from modelyard.protocol.openai import StrictRequest

MAX_INPUTS = 2048  # OpenAI's own limit on the inputs of one request


class EmbeddingRequest(StrictRequest):
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    model: Name = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1, le=2**16)
    user: Name | None = None

    @field_validator("input")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        # Each text or token list as the bounds say (its length against the model's own limit
        # is the encoder's check); the count of inputs is `inputs()`'s, with OpenAI's message.
        items = (
            [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
        )
        at_most(items, 32 * MAX_INPUTS, "inputs")
        for i, item in enumerate(items):
            if isinstance(item, str):
                at_most(item, MAX_TEXT_CHARS)
            else:
                check_token_ids(item, f"input[{i}]")
        return value

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list, checked against OpenAI's limits (400 naming `input`)."""
        raw = self.input
        if isinstance(raw, str):
            inputs: list[Any] = [raw]
        elif raw and isinstance(raw[0], int):
            inputs = [raw]  # one input given as token ids
        else:
            inputs = list(raw)
        if not inputs:
            raise bad_request("'input' must not be an empty list.", "input", "invalid_value")
        if len(inputs) > MAX_INPUTS:
            raise bad_request(
                f"'input' holds {len(inputs)} inputs, more than the limit of {MAX_INPUTS}.",
                "input",
                "invalid_value",
            )
        for i, x in enumerate(inputs):
            if len(x) == 0:
                what = "an empty string" if isinstance(x, str) else "an empty token list"
                raise bad_request(
                    f"Invalid 'input[{i}]': {what}; inputs must not be empty.",
                    "input",
                    "invalid_value",
                )
        return inputs


def embedding_response(
    model: str,
    vectors: np.ndarray,
    token_counts: Sequence[int],
    encoding_format: Literal["float", "base64"],
) -> dict[str, Any]:
    data = []
    for i, vector in enumerate(vectors):
        if encoding_format == "base64":
            embedding: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        else:
            embedding = vector  # orjson writes float32 arrays at float32 precision
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    tokens = int(sum(token_counts))
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
