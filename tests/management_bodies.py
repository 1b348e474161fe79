"""Hypothesis strategies for the management API's request bodies, from the pydantic models'
own JSON schemas: valid bodies (every field within its bounds) and hostile ones (values at and
past the bounds, unknown fields at any level, arbitrary JSON in place of a field, deep nesting).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel

# Arbitrary JSON, a little of it nested.
JSON: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"a": value}
    return value


# Junk in place of a field: any JSON, a long string, a very deep object.
JUNK = st.one_of(
    JSON, st.integers(4000, 6000).map(lambda n: "x" * n), st.sampled_from([70, 300]).map(_nested)
)


def _misplaced_names() -> list[str]:
    """Names the platform knows, to put where they are not declared: every field of the
    management models and of what the control plane builds from them (the scaling policy, the
    engine settings)."""
    from modelyard.api.routes_batch import BatchCreate
    from modelyard.api.routes_endpoints import EndpointUpdate
    from modelyard.api.routes_versions import VersionAdd
    from modelyard.config import EngineSettings
    from modelyard.control.autoscaler import ScalingPolicy
    from modelyard.protocol import management

    names = {f.name for f in fields(ScalingPolicy)} | set(EngineSettings.model_fields)
    for model in (
        management.DeployRequest, management.Hardware, management.Scaling,
        management.SamplingDefaults, management.TenantCreate, management.TenantUpdate,
        management.KeyCreate, management.KeyUpdate, management.VersionCreate, EndpointUpdate,
        VersionAdd, BatchCreate,
    ):  # fmt: skip
        names |= set(model.model_fields)
    return sorted(names)


def body(model: type[BaseModel], hostile: bool) -> st.SearchStrategy[dict[str, Any]]:
    schema = model.model_json_schema()
    return _plain(schema, schema.get("$defs", {}), hostile)  # type: ignore[no-any-return]


def _value(s: dict[str, Any], defs: dict[str, Any], hostile: bool) -> st.SearchStrategy[Any]:
    plain = _plain(s, defs, hostile)
    return st.one_of(plain, plain, plain, JUNK) if hostile else plain


def _plain(s: dict[str, Any], defs: dict[str, Any], hostile: bool) -> st.SearchStrategy[Any]:
    if "$ref" in s:
        return _value(defs[s["$ref"].rsplit("/", 1)[1]], defs, hostile)
    if "anyOf" in s:
        return st.one_of([_value(x, defs, hostile) for x in s["anyOf"]])
    if "enum" in s:
        return st.sampled_from(s["enum"])
    kind = s.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        return _number(s, kind == "integer", hostile)
    if kind == "string":
        most = s.get("maxLength", 40)
        text = st.text(min_size=s.get("minLength", 0), max_size=min(most, 40))
        if "pattern" in s:
            text = st.from_regex(s["pattern"], fullmatch=True)
        return st.one_of(text, st.just("y" * (most + 1))) if hostile else text
    if kind == "array":
        items = _value(s.get("items", {}), defs, hostile) if s.get("items") else JSON
        most = s.get("maxItems", 4)
        lists = st.lists(items, min_size=s.get("minItems", 0), max_size=min(most, 4))
        return (
            st.one_of(lists, st.lists(items, min_size=most + 1, max_size=most + 1))
            if hostile
            else lists
        )
    if kind == "object" and "properties" in s:
        required = set(s.get("required", ()))
        props = {k: _value(v, defs, hostile) for k, v in s["properties"].items()}
        optional = {k: v for k, v in props.items() if k not in required}
        fixed = st.fixed_dictionaries({k: props[k] for k in required}, optional=optional)
        if not hostile:
            return fixed
        # Unknown fields at every level: new names, and names declared elsewhere.
        names = st.sampled_from(["unknown_field", *MISPLACED])
        extra = st.dictionaries(names.filter(lambda n: n not in props), JUNK, max_size=2)
        return st.tuples(fixed, extra).map(lambda both: {**both[1], **both[0]})
    if kind == "object":
        extra = s.get("additionalProperties")
        values = _value(extra, defs, hostile) if isinstance(extra, dict) else JSON
        names = {"type": "string", "maxLength": 20, **s.get("propertyNames", {})}
        keys = _plain(names, defs, hostile)  # strings, some past their bound
        most = s.get("maxProperties", 4)
        return st.dictionaries(
            keys, values, min_size=s.get("minProperties", 0), max_size=min(most, 4)
        )
    return JSON


def _number(s: dict[str, Any], integer: bool, hostile: bool) -> st.SearchStrategy[Any]:
    lo = s.get("minimum", s.get("exclusiveMinimum"))
    hi = s.get("maximum", s.get("exclusiveMaximum"))
    if integer:
        inside: st.SearchStrategy[Any] = st.integers(
            None if lo is None else int(lo) + ("exclusiveMinimum" in s),
            None if hi is None else int(hi) - ("exclusiveMaximum" in s),
        )
    else:
        inside = st.floats(
            lo, hi, allow_nan=False, allow_infinity=False,
            exclude_min="exclusiveMinimum" in s, exclude_max="exclusiveMaximum" in s,
        )  # fmt: skip
    if not hostile:
        return inside
    edges = [x for x in (lo, hi) if x is not None]
    past = [x - 1 for x in edges] + [x + 1 for x in edges] + [x * 1e6 for x in edges if x]
    return st.one_of(inside, st.sampled_from(edges + past + [2**63, -(2**63) - 1, 1e308]))


MISPLACED = _misplaced_names()
