"""Tool calling at the API edge: function tools, the tool choice, and tool calls in the history.

Shapes follow OpenAI's chat completions API; the legacy `functions` / `function_call` fields
use the same function definition. A tool's `parameters` is a JSON schema: it must be an object
(deeper checks happen when it is compiled into a grammar, at the worker). Names follow
OpenAI's rule (`^[a-zA-Z0-9_-]{1,64}$`), so a name can be quoted in a prompt and a grammar.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from modelyard.protocol.bounds import JSONObject, Name, Text

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128  # OpenAI's own limit
_NAME = re.compile(NAME_PATTERN)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_parameters(value)

    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (OpenAI: no parameters means an empty parameter list)."""
        return self.parameters or {"type": "object", "properties": {}}

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool shape, as chat templates and prompts read it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters_schema()
        return {"type": "function", "function": fn}


def check_parameters(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """Arguments are a JSON object: a parameter schema of another type can never be met."""
    if value is not None and value.get("type", "object") != "object":
        raise ValueError("parameters must be a JSON schema of type 'object'")
    return value


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
# Legacy: "none", "auto" or {"name": ...}.
FunctionCallChoice = Literal["none", "auto"] | FunctionName


class FunctionCall(BaseModel):
    """A call in the history: `arguments` is JSON text, as the API returns it."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    arguments: Text = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


def check_tools(tools: list[ChatTool]) -> list[ChatTool]:
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools are allowed")
    names = [t.function.name for t in tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"tool names must be unique; {', '.join(dupes)} appears twice")
    return tools


class ToolFields(BaseModel):
    """The tool-calling fields of a chat request, legacy ones included."""

    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: Annotated[list[FunctionDefinition], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="Deprecated: tools."
    )
    function_call: FunctionCallChoice | None = Field(None, description="Deprecated: tool_choice.")

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[ChatTool] | None) -> list[ChatTool] | None:
        return None if value is None else check_tools(value)

    @field_validator("functions")
    @classmethod
    def _functions(cls, value: list[FunctionDefinition] | None) -> list[FunctionDefinition] | None:
        if value is not None:
            check_tools([ChatTool(type="function", function=f) for f in value])
        return value


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))
