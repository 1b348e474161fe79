"""`protocol/json_depth.py`: the depth measured on a body's bytes is the depth of the JSON it
holds, whatever its strings contain (brackets, quotes, escapes)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from modelyard.protocol.json_depth import MAX_JSON_DEPTH, json_depth, too_deep

# Strings full of what could fool a scanner: brackets, quotes, backslashes, escapes.
TRICKY = st.text(alphabet='[]{}"\\/ a\n\u00e9\U0001d518', max_size=8)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TRICKY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
    max_leaves=40,
)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@settings(max_examples=400, deadline=None)
@given(value=VALUES, ascii_only=st.booleans(), indent=st.sampled_from([None, 2]))
def test_depth_on_bytes_is_the_json_depth(value: Any, ascii_only: bool, indent: int | None) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode()
    assert json_depth(body) == _depth(value)


def test_the_bound() -> None:
    def nested(depth: int) -> bytes:
        return b'{"a":' * (depth - 1) + b"[]" + b"}" * (depth - 1)

    assert too_deep(nested(MAX_JSON_DEPTH)) is None
    assert too_deep(b'["' + b"[" * 5000 + b'"]') is None  # brackets inside a string
    assert f"{MAX_JSON_DEPTH + 1} levels" in (too_deep(nested(MAX_JSON_DEPTH + 1)) or "")
