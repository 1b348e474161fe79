"""The prompt side of tool calling: what the chat template receives.

A chat template that renders tools itself (it reads `tools`, as Hermes, Qwen, Llama 3.1+ and
Mistral templates do) gets them as transformers passes them, with the history's assistant
`tool_calls` (arguments as objects) and `tool` results as messages. Otherwise (SmolLM2's
template has no tools) the DEFAULT TOOL PROMPT, a Hermes-style system section listing the
functions and the `<tool_call>` format, is added to the system message, and the history's calls
and results are written in that format (results as `<tool_response>` blocks in a user turn).
"""

from __future__ import annotations

import json
from typing import Any

from modelyard.protocol.openai import ChatMessage
from modelyard.worker.tools import ToolMode, ToolPlan

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
REQUIRED_NOTE = "\n\nYou must call at least one function now."
NAMED_NOTE = "\n\nYou must call the function `{name}` now: answer with its arguments object."


def _arguments_object(text: str) -> Any:
    """Templates read arguments as a mapping (transformers passes dicts); JSON text that is
    not an object stays text."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def _calls_of(m: ChatMessage) -> list[tuple[str, str, str]]:
    """(id, name, arguments text) of an assistant message's calls, legacy ones included."""
    calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
    if m.function_call is not None:
        calls.append(("call_legacy", m.function_call.name, m.function_call.arguments))
    return calls


def _tool_names(messages: list[ChatMessage]) -> dict[str, str]:
    """The function name of each call id in the history (tool results name their call)."""
    return {cid: name for m in messages for cid, name, _ in _calls_of(m)}


def template_messages(
    messages: list[ChatMessage], plan: ToolPlan, renders_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` argument for the chat template (see the module's docstring)."""
    tools = [f.as_tool() for f in plan.functions] if plan.active else None
    names = _tool_names(messages)
    if renders_tools:
        return [_native(m, names) for m in messages], tools
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role in ("tool", "function"):
            name = m.name or names.get(m.tool_call_id or "", "")
            block = "<tool_response>\n" + json.dumps(
                {"name": name, "content": m.text()}, ensure_ascii=False
            ) + "\n</tool_response>"  # fmt: skip
            if out and out[-1].get("_tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        content = m.text()
        calls = _calls_of(m) if m.role == "assistant" else []
        for _, name, args in calls:
            obj = {"name": name, "arguments": _arguments_object(args)}
            content += ("\n" if content else "") + (
                f"<tool_call>\n{json.dumps(obj, ensure_ascii=False)}\n</tool_call>"
            )
        out.append({"role": m.role, "content": content})
    for turn in out:
        turn.pop("_tool_results", None)
    if tools:
        section = default_tool_prompt(plan)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, None


def _native(m: ChatMessage, names: dict[str, str]) -> dict[str, Any]:
    role = "tool" if m.role == "function" else m.role
    msg: dict[str, Any] = {"role": role, "content": m.text()}
    if m.role == "assistant" and m.reasoning_content is not None:
        msg["reasoning_content"] = m.reasoning_content  # Qwen3's template renders it again
    if m.role == "assistant" and (calls := _calls_of(m)):
        msg["tool_calls"] = [
            {
                "id": cid,
                "type": "function",
                "function": {"name": name, "arguments": _arguments_object(args)},
            }
            for cid, name, args in calls
        ]
    if role == "tool":
        msg["tool_call_id"] = m.tool_call_id
        if name := m.name or names.get(m.tool_call_id or ""):
            msg["name"] = name
    return msg


def default_tool_prompt(plan: ToolPlan) -> str:
    listed = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in plan.functions)
    text = DEFAULT_TOOL_PROMPT.format(tools=listed)
    if plan.mode is ToolMode.REQUIRED:
        text += REQUIRED_NOTE
    elif plan.mode is ToolMode.NAMED:
        text += NAMED_NOTE.format(name=plan.named)
    return text
