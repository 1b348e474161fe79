"""How many tokens a request may use at most: the bound that TPM and the monthly quota reserve
at admission, before any tokenizer has seen the request (settlement corrects it to the real
count afterwards).

A reservation that can fall short of the real count lets a burst overrun the quota and TPM by
the shortfall of every request in it, so this is a bound, not an estimate:

- prompt: the UTF-8 bytes of everything a chat template or tokenizer turns into tokens
  (message text, roles, names, tool definitions and calls, instructions, prompts, inputs),
  since byte-level BPE and SentencePiece with byte fallback never make more tokens than the
  text has bytes; structured values (tools, tool calls, content parts that are not text) are
  counted as templates may render them, as JSON indented by up to 4 spaces: twice their size
  indented by 2 (indentation is at most half of such JSON, and doubling it covers 4); token ids
  count one each. Plus what the template itself adds (see the overheads below).
- completion: `max_tokens` (or `max_completion_tokens`, `max_output_tokens`), else the
  endpoint's cap, which is what the worker generates at most when none is given; times `n`,
  times the number of prompts of a completions request. Embeddings generate nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import orjson

# What a chat template adds around one message: role header and end-of-turn special tokens
# (ChatML `<|im_start|>role\n…<|im_end|>\n`, Llama 3's header ids: 4-6 tokens, the role's own
# text counted apart), with margin.
MESSAGE_OVERHEAD = 16
# What a template adds once per request: BOS, the generation prompt, and the default system
# prompt some templates insert when none is given (SmolLM2, Qwen2.5, Llama 3.1's date lines:
# under 40 tokens), with margin. A completions or embeddings prompt gets the same (BOS/EOS,
# CLS/SEP: a few tokens).
REQUEST_OVERHEAD = 128
# What a template adds when the request carries tools: the worker's default tool prompt (about
# 430 bytes, `worker/tool_prompt.py`) or a template's own tool preamble (Llama 3.1's, Hermes':
# a few hundred bytes), and the notes for `tool_choice`.
TOOLS_OVERHEAD = 1024
# Per embedding input: BOS/EOS or CLS/SEP and the like.
INPUT_OVERHEAD = 8


def reservation_bound(kind: str, payload: dict[str, Any], completion_cap: int) -> int:
    """The most tokens (prompt and completion) the request `payload` of route `kind` can be
    billed, given the endpoint's cap on generated tokens when the request names none."""
    if kind == "embeddings":
        return _inputs(payload.get("input"))
    if kind == "completions":
        prompts = _prompts(payload.get("prompt"))
        prompt = sum(_prompt(p) for p in prompts)
        n_prompts = max(1, len(prompts))
    else:
        prompt = REQUEST_OVERHEAD + _chat(payload)
        n_prompts = 1
    max_tokens = (
        payload.get("max_completion_tokens")
        or payload.get("max_tokens")
        or payload.get("max_output_tokens")
    )
    per_choice = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else completion_cap
    n = payload.get("n")
    choices = n if isinstance(n, int) and n > 0 else 1
    return prompt + per_choice * choices * n_prompts


def _bytes(text: str) -> int:
    # ASCII text (the common case) is its length; else its UTF-8 encoding's (lone surrogates,
    # which JSON can carry, as the 3 bytes the worker's encoding would give them at most).
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def _structured(value: Any) -> int:
    """Bytes of `value` rendered as JSON indented by up to 4 spaces (see the docstring)."""
    try:
        return 2 * len(orjson.dumps(value, option=orjson.OPT_INDENT_2))
    except TypeError:  # not JSON (cannot come from a parsed body): its text instead
        return 2 * _bytes(str(value))


def _text_or_structured(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return _bytes(value)
    return _structured(value)


def _arguments(text: str) -> int:
    """A tool call's arguments: templates get them as an object and may render it indented."""
    total = _bytes(text)
    if text[:1] in ("{", "["):
        with contextlib.suppress(orjson.JSONDecodeError):
            total += _structured(orjson.loads(text))
    return total


def _content(content: Any) -> int:
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                total += _bytes(part["text"]) + MESSAGE_OVERHEAD
            else:
                total += _structured(part)
        return total
    return _text_or_structured(content)


def _calls(calls: Any) -> int:
    """Tool calls (a list) or a legacy function call (one object)."""
    total = _structured(calls)
    for call in calls if isinstance(calls, list) else [calls]:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            total += _arguments(fn["arguments"])
    return total


def _item(item: Any) -> int:
    """One chat message or Responses input item."""
    if not isinstance(item, dict):
        return MESSAGE_OVERHEAD + _text_or_structured(item)
    total = MESSAGE_OVERHEAD
    for key, value in item.items():
        if key == "content":
            total += _content(value)
        elif key in ("tool_calls", "function_call"):
            total += _calls(value)
        elif key == "arguments" and isinstance(value, str):
            total += _arguments(value)
        else:
            total += _bytes(key) + _text_or_structured(value)
    return total


def _chat(payload: dict[str, Any]) -> int:
    """Chat completions and Responses: messages or input items, instructions, tools."""
    total = 0
    items = payload.get("messages", payload.get("input"))
    if isinstance(items, list):
        total += sum(_item(m) for m in items)
    else:
        total += MESSAGE_OVERHEAD + _text_or_structured(items)
    if payload.get("instructions") is not None:
        total += MESSAGE_OVERHEAD + _text_or_structured(payload["instructions"])
    tools = [payload.get(k) for k in ("tools", "functions") if payload.get(k)]
    if tools:
        total += TOOLS_OVERHEAD + sum(_structured(t) for t in tools)
        total += _text_or_structured(payload.get("tool_choice"))
        total += _text_or_structured(payload.get("function_call"))
    return total


def _prompts(prompt: Any) -> list[Any]:
    """A completions prompt as its list of prompts (text or token ids)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return prompt
    return [prompt]


def _prompt(prompt: Any) -> int:
    if isinstance(prompt, list):  # token ids: one token each
        return len(prompt) + REQUEST_OVERHEAD
    return _text_or_structured(prompt) + REQUEST_OVERHEAD


def _inputs(inputs: Any) -> int:
    if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int):
        return sum(_inputs(i) for i in inputs)
    if isinstance(inputs, list):
        return len(inputs) + INPUT_OVERHEAD
    return _text_or_structured(inputs) + INPUT_OVERHEAD
