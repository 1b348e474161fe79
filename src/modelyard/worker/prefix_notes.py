"""The worker's part in cache-aware routing: the gateway's prefix keys of each request go to the
engine, and its health report says which of them the engine's prefix cache holds.

The gateway sends a request's keys (`core/prefix_keys.py`) in a header; `note` hands them to the
engine (for a chat, a Responses request as the chat it runs as, and a completion of one prompt)
with, for each, how many of the prompt's tokens its text spans, and the engine ties them
to its KV blocks (`engine/prefix_digest.py`). `digest` is the health report's entry: the keys
whose blocks are still cached, most recently used first, bounded (`MAX_DIGEST_KEYS`), with the
engine's count of noted requests as its generation. A request for an adapter is not noted: its
blocks are the adapter's (the gateway routes it by the adapter).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modelyard.core.prefix_keys import (
    HEADER,
    MAX_DIGEST_KEYS,
    encode_digest,
    from_header,
    token_ends,
)
from modelyard.engine.client import EngineClient, SamplingParams


def note(
    engine: EngineClient,
    headers: Mapping[str, str],
    prompt: list[int],
    cache_salt: str | None,
    params: SamplingParams,
) -> None:
    """Hand the request's prefix keys, if the gateway sent them, to the engine."""
    if params.lora is not None:
        return
    keys = from_header(headers.get(HEADER))
    if keys is not None:
        engine.note_prefix(prompt, cache_salt, keys.keys, token_ends(keys, len(prompt)))


def digest(engine: EngineClient) -> dict[str, Any]:
    """The health report's `prefix_digest`: {generation, keys (base64 of 8-byte keys)}."""
    generation, held = engine.prefix_digest(MAX_DIGEST_KEYS)
    return {"generation": generation, "keys": encode_digest(held)}
