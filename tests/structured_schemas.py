"""Twenty small JSON schemas for the structured-output tests and benchmark: nested objects,
arrays, enums, required fields, anyOf, string formats and bounded numbers. Each comes with a
prompt that asks for it, as an application would."""

from __future__ import annotations

from typing import Any

_S = {"type": "string", "maxLength": 40}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": ("Describe a person.", _obj({"name": _S, "age": {"type": "integer"}})),
    "city": (
        "Describe a city.",
        _obj({"city": _S, "country": _S, "population": {"type": "integer", "minimum": 0}}),
    ),
    "color_enum": (
        "Pick a color.",
        _obj({"color": {"enum": ["red", "green", "blue"]}}),
    ),
    "rating": (
        "Rate a movie from 1 to 5.",
        _obj({"title": _S, "stars": {"type": "integer", "minimum": 1, "maximum": 5}}),
    ),
    "temperature": (
        "Give a temperature reading.",
        _obj({"celsius": {"type": "number", "minimum": -90, "maximum": 60}}),
    ),
    "tags": (
        "List tags for a blog post.",
        _obj({"tags": {"type": "array", "items": _S, "minItems": 1, "maxItems": 4}}),
    ),
    "nested_address": (
        "Give a company and its address.",
        _obj(
            {
                "company": _S,
                "address": _obj({"street": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
            }
        ),
    ),
    "order": (
        "Write an order with its items.",
        _obj(
            {
                "order_id": {"type": "integer", "minimum": 1},
                "items": {
                    "type": "array",
                    "items": _obj(
                        {"sku": _S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}
                    ),
                    "minItems": 1,
                    "maxItems": 3,
                },
            }
        ),
    ),
    "optional_fields": (
        "Describe a book.",
        _obj({"title": _S, "year": {"type": "integer"}, "isbn": _S}, required=["title"]),
    ),
    "any_of": (
        "Give an identifier.",
        _obj({"id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 12}]}}),
    ),
    "nullable": (
        "Describe a user and their middle name if any.",
        _obj({"first": _S, "middle": {"anyOf": [_S, {"type": "null"}]}}),
    ),
    "email": (
        "Give a contact.",
        # no maxLength: the grammar bounds it (engine.grammar.bound_strings)
        _obj({"name": _S, "email": {"type": "string", "format": "email"}}),
    ),
    "date": (
        "When is the meeting?",
        _obj({"topic": _S, "date": {"type": "string", "format": "date"}}),
    ),
    "uuid": (
        "Give a record.",
        _obj({"id": {"type": "string", "format": "uuid"}, "ok": {"type": "boolean"}}),
    ),
    "boolean_flags": (
        "Describe feature flags.",
        _obj({"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"}}),
    ),
    "matrix": (
        "Give a 2x2 matrix.",
        _obj(
            {
                "rows": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": -9, "maximum": 9},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 2,
                    "maxItems": 2,
                }
            }
        ),
    ),
    "enum_array": (
        "Which weekdays are you free?",
        _obj(
            {
                "days": {
                    "type": "array",
                    "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                    "minItems": 1,
                    "maxItems": 5,
                }
            }
        ),
    ),
    "price": (
        "Price a product.",
        _obj(
            {
                "product": _S,
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                "currency": {"enum": ["USD", "EUR", "GBP"]},
            }
        ),
    ),
    "refs": (
        "Give two points.",
        {
            "$defs": {"point": _obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    ),
    "sentiment": (
        "Classify the sentiment of: 'I love this phone'.",
        _obj(
            {
                "label": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
}
