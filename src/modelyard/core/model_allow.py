"""Per-key model allow-lists: does a model name match one of a key's patterns (`*` matches any
run of characters, nothing else is special)?

The match is linear in the name's length per pattern (segments found in order, no regular
expression, no backtracking), so a tenant's patterns cannot make it slow.
"""

from __future__ import annotations

from collections.abc import Iterable

from modelyard.core.errors import Forbidden


def glob_match(pattern: str, name: str) -> bool:
    """`name` matches `pattern`, where `*` is any run of characters (also none)."""
    parts = pattern.split("*")
    if len(parts) == 1:
        return pattern == name
    first, *middle, last = parts
    if len(name) < len(first) + len(last):
        return False
    if not name.startswith(first) or not name.endswith(last):
        return False
    at, end = len(first), len(name) - len(last)
    for part in middle:
        found = name.find(part, at, end)
        if found < 0:
            return False
        at = found + len(part)
    return True


def allows(patterns: Iterable[str] | None, name: str) -> bool:
    """None: no allow-list, every model; else `name` matches one of `patterns`."""
    if patterns is None:
        return True
    return any(glob_match(p, name) for p in patterns)


def model_not_allowed(name: str) -> Forbidden:
    shown = name if len(name) <= 100 else name[:100] + "…"
    return Forbidden(
        f"This API key is not allowed to use the model '{shown}' (see the key's allowed_models).",
        param="model",
        code="model_not_allowed",
    )
