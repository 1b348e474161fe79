"""How deeply a JSON body nests, measured on its bytes, and the bound every body is held to.

Deeply nested JSON parses (orjson takes 1,024 levels, the standard library about 1,000) but
breaks what handles it next: orjson writes at most 255 levels (the gateway re-serialises every
request for the worker), recursive walks hit Python's recursion limit, and JSON schemas in
`response_format` or `tools` are compiled recursively into grammars. Every JSON body is held to
`MAX_JSON_DEPTH` at the edge, a 400 naming the limit, before anything walks it.

The depth is counted on the bytes, with no Python loop per byte: a body with no more brackets
than the bound is within it (two `bytes.count`: what nearly every request pays); otherwise string
literals are cut out (a bracket inside a string does not nest) and the running sum of +1 for
`[`/`{` and -1 for `]`/`}` is taken with numpy: about 0.1-0.2 s for 8 MiB of brackets or short
strings, so large bodies are measured off the event loop where the caller can (`SLOW_BYTES`).
"""

from __future__ import annotations

import re

import numpy as np

# Levels of arrays and objects, the body itself being level 1. OpenAI's structured outputs allow
# 10 levels of schema objects (about 25 levels of JSON with the request around them).
MAX_JSON_DEPTH = 64
# Bodies at least this large are measured in a worker thread by callers on an event loop.
SLOW_BYTES = 256 * 1024

# A JSON string literal (the unrolled form: no backtracking on long strings).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body` (valid JSON: its strings are closed)."""
    if b"[" not in body and b"{" not in body:
        return 0
    bare = _STRING.sub(b"", body) if b'"' in body else body
    steps = _STEP[np.frombuffer(bare, dtype=np.uint8)]
    steps = steps[steps != 0]
    if steps.size == 0:
        return 0
    return int(np.cumsum(steps, dtype=np.int32).max())


def too_deep(body: bytes) -> str | None:
    """Why `body` is refused for its nesting, or None when it is within the bound."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return None
    depth = json_depth(body)
    if depth <= MAX_JSON_DEPTH:
        return None
    return (
        f"The JSON body nests {depth} levels deep; at most {MAX_JSON_DEPTH} levels of arrays "
        "and objects are accepted."
    )
