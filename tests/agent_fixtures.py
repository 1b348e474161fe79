"""What the agent-API tests share (tool calling, structured outputs, the Responses API): the
SmolLM2 worker's clients, the tools they call in both API shapes, and small request helpers.

Each module keeps its own two-line fixtures over the session's one SmolLM2 worker
(`tests.conftest`): fixtures imported from here would read as redefinitions to ruff (F811).
"""

from __future__ import annotations

from typing import Any

import openai

from tests.conftest import WorkerProcess

MODEL = "smollm2"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def responses_tool(chat_tool: dict[str, Any]) -> dict[str, Any]:
    """A chat tool in the Responses API's flat shape (`{"type", "name", "parameters", …}`)."""
    return {"type": "function", **chat_tool["function"]}


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def response_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def sdk_client(worker: WorkerProcess) -> openai.OpenAI:
    """The `openai` SDK on a worker (each module's `client` fixture)."""
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)
