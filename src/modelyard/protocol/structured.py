"""Request schemas for structured outputs: OpenAI's `response_format` and vLLM's `guided_*` extras.

`response_format` is `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",
"json_schema": {"name", "description", "schema", "strict"}}`; unknown keys inside it are refused
(never silently dropped). vLLM-style extras (`guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`) are accepted too. Which of them a request may combine, and sizes, are checked by
the worker (`modelyard.worker.structured`); whether a schema compiles, by the grammar compiler.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from modelyard.protocol.bounds import (
    MAX_GUIDED_CHOICES,
    MAX_SPEC_CHARS,
    JSONObject,
    SpecText,
    Text,
    at_most,
    bounded_json,
)

# OpenAI's rule for a json_schema name.
SCHEMA_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class ResponseFormatText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class ResponseFormatJSONObject(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_object"]


class JSONSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=SCHEMA_NAME_PATTERN)
    description: Text | None = None
    # `schema` would shadow a BaseModel attribute: schema_ here, `schema` on the wire.
    schema_: JSONObject | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormatJSONSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
    Field(discriminator="type"),
]


class StructuredFields(BaseModel):
    """The structured-output fields of chat and completion requests."""

    response_format: ResponseFormat | None = None
    # vLLM's extras: a JSON schema (object or JSON text), a regex, a list of choices, an EBNF.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: SpecText | None = None
    guided_choice: Annotated[list[SpecText], Field(max_length=MAX_GUIDED_CHOICES)] | None = None
    guided_grammar: SpecText | None = None

    @field_validator("guided_json")
    @classmethod
    def _bounded_json(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
        if isinstance(value, str):
            return at_most(value, MAX_SPEC_CHARS)
        return bounded_json(value)
