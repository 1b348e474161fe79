"""A request's prompt prefix as a chain of block keys, and a replica's digest of the keys it holds.

The gateway has a request's messages, not its tokens (it runs no tokenizer). It renders the prompt
canonically — the model (an adapter has its own cache), the cache namespace (`cache_salt`:
tenants never share blocks), the tools, then every message's role, text and tool calls in order;
for a completion, the prompt (one prompt, or a list of exactly one) — and cuts the rendering into
blocks of `BLOCK_CHARS` characters. A Responses API request is rendered as the chat the worker
runs it as (`worker/responses.py` `to_chat`: `instructions` as the system message, a string
`input` as a user message, message items' text, a `function_call` item as a tool call of the
assistant's turn, a `function_call_output` as a tool message, function tools in chat's form), so
it keys like that chat and shares its cached blocks; the server keeps no responses, so there is
no stored context (`previous_response_id` is refused before routing) to key. Block
i's key is a 64-bit hash chained over block i-1's key and block i's text, so two requests with
an equal key have equal rendered text up to that block's end. Only the first `MAX_KEYS` blocks
are keyed (a prefix longer than that is matched as far as that).

The gateway hands the keys to the replica it picks (`HEADER`, with the rendering's length). The
replica's engine ties each key to the KV block that holds the prompt's tokens up to the key's end
(its proportional position in the prompt: `token_ends`) and publishes, in its health report, the
keys whose block is still in its prefix cache: a digest of at most `MAX_DIGEST_KEYS` keys, most
recently used first (`encode_digest`). The gateway routes by those digests
(`core/cache_routing.py`). A key says "this replica's cache holds the KV of this text", exactly
as far as its engine's blocks do: an evicted block drops its keys from the next digest. In
cluster mode only the leading controller reads the reports; it shares each digest with the
gateways through Redis (`share_digest`, `parse_shared`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

BLOCK_CHARS = 256  # characters per key (about 64 tokens)
MAX_KEYS = 64  # keys per request: the first 16,384 characters of the rendering
KEY_BYTES = 8
MAX_DIGEST_KEYS = 2048  # keys per replica's digest (16 KiB, 22 KiB as base64)
HEADER = "x-modelyard-prefix-keys"
_HEADER_MAX = 24 + 4 * (MAX_KEYS * KEY_BYTES) // 3 + 4


@dataclass(frozen=True)
class PrefixKeys:
    """A request's block keys and the length of its whole canonical rendering (characters)."""

    keys: tuple[bytes, ...]
    length: int


def _text(content: Any) -> str:
    """A message's content as text (parts joined; non-text parts by their JSON)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                out.append(str(part.get("text", "")))
            else:
                out.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
        return "".join(out)
    return "" if content is None else orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def _message(m: dict[str, Any]) -> str:
    calls = m.get("tool_calls")
    rendered = f"\x1e{m.get('role', '')}\x1f{_text(m.get('content'))}"
    if calls:  # the model reads its earlier calls too
        rendered += "\x1f" + orjson.dumps(calls, option=orjson.OPT_SORT_KEYS).decode()
    return rendered


def _item_text(content: Any) -> str:
    """A Responses message item's text (`MessageItem.text`: text parts and refusals joined)."""
    if not isinstance(content, list):
        return _text(content)
    return "".join(
        str(p.get("refusal", "")) if p.get("type") == "refusal" else str(p.get("text", ""))
        for p in content
        if isinstance(p, dict)
    )


def responses_as_chat(payload: dict[str, Any]) -> dict[str, Any]:
    """The chat request's messages and tools a Responses API request runs as (see the module's
    docstring), for `render`."""
    messages: list[dict[str, Any]] = []
    if payload.get("instructions"):
        messages.append({"role": "system", "content": payload["instructions"]})
    items = payload.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _item_text(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn: text and calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")}
            )
    tools = [
        {
            "type": "function",
            "function": {k: v for k, v in t.items() if k != "type" and v is not None},
        }
        for t in payload.get("tools") or ()
        if isinstance(t, dict)
    ]
    return {"model": payload.get("model", ""), "cache_salt": payload.get("cache_salt"),
            "tools": tools, "messages": messages}  # fmt: skip


def render(payload: dict[str, Any], kind: str | None = None) -> str | None:
    """The canonical rendering of a chat, completion or (`kind` "responses") Responses API
    request (None: nothing to key on)."""
    if kind == "responses":
        payload = responses_as_chat(payload)
    elif kind == "embeddings":
        return None
    head = f"{payload.get('model', '')}\x1d{payload.get('cache_salt') or ''}\x1d"
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        tools = payload.get("tools")
        parts = [head, orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode() if tools else ""]
        parts.extend(_message(m) for m in messages if isinstance(m, dict))
        return "".join(parts)
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list: the worker runs it as that prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):  # token ids
        return head + ",".join(map(str, prompt))
    if isinstance(prompt, str) and prompt:
        return head + prompt
    return None  # several prompts in one request, embeddings, …: least-loaded


def chain(text: str) -> tuple[bytes, ...]:
    """The chained keys of the first `MAX_KEYS` blocks of `text` (a last partial block too)."""
    keys: list[bytes] = []
    parent = b""
    for start in range(0, min(len(text), MAX_KEYS * BLOCK_CHARS), BLOCK_CHARS):
        block = text[start : start + BLOCK_CHARS].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(block, digest_size=KEY_BYTES, key=parent).digest()
        keys.append(parent)
    return tuple(keys)


def prefix_keys(payload: dict[str, Any], kind: str | None = None) -> PrefixKeys | None:
    """The keys of a request of `kind` (the gateway's: "chat.completions", "completions",
    "responses", "embeddings"; None: a chat or a completion, told apart by their fields)."""
    rendered = render(payload, kind)
    if rendered is None:
        return None
    return PrefixKeys(chain(rendered), len(rendered))


def token_ends(prefix: PrefixKeys, num_tokens: int) -> list[int]:
    """For each key, how many of the prompt's `num_tokens` tokens its text spans (its end's
    proportional position in the prompt, rounded down: a key never claims a token past it)."""
    length = max(1, prefix.length)
    return [
        num_tokens * min(length, (i + 1) * BLOCK_CHARS) // length for i in range(len(prefix.keys))
    ]


def to_header(prefix: PrefixKeys) -> str:
    return f"{prefix.length}:{base64.b64encode(b''.join(prefix.keys)).decode()}"


def from_header(value: str | None) -> PrefixKeys | None:
    """The keys a gateway sent with a request; None if absent or malformed (bounded parse)."""
    if not value or len(value) > _HEADER_MAX:
        return None
    length, _, encoded = value.partition(":")
    try:
        raw = base64.b64decode(encoded, validate=True)
        n = int(length)
    except (ValueError, binascii.Error):
        return None
    if n < 0 or not raw or len(raw) % KEY_BYTES or len(raw) > MAX_KEYS * KEY_BYTES:
        return None
    keys = tuple(raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES))
    return PrefixKeys(keys, n)


def encode_digest(keys: Iterable[bytes]) -> str:
    """A replica's held keys for its health report (at most `MAX_DIGEST_KEYS`)."""
    out = bytearray()
    for i, key in enumerate(keys):
        if i == MAX_DIGEST_KEYS:
            break
        out += key
    return base64.b64encode(bytes(out)).decode()


def decode_digest(value: Any) -> frozenset[bytes] | None:
    """A health report's digest as a set of keys; None if absent or malformed."""
    if not isinstance(value, str) or len(value) > 4 * (MAX_DIGEST_KEYS * KEY_BYTES) // 3 + 4:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (ValueError, binascii.Error):
        return None
    if len(raw) % KEY_BYTES:
        return None
    return frozenset(raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES))


# A shared digest's longest text: a generation of up to 19 digits, a space, the keys.
_SHARED_MAX = 20 + 4 * (MAX_DIGEST_KEYS * KEY_BYTES) // 3 + 4


def share_digest(generation: int, held: Iterable[bytes]) -> str:
    """A replica's digest as the leading controller shares it with the gateways (cluster mode:
    `control/digest_publisher.py`): `<generation> <keys in base64>`."""
    return f"{generation} {encode_digest(held)}"


def stamp(shared: str) -> str:
    """A short hash of a shared digest: whether a gateway's copy of it is the current one."""
    return hashlib.blake2b(shared.encode(), digest_size=8).hexdigest()


def parse_shared(value: Any) -> tuple[int, frozenset[bytes]] | None:
    """A shared digest (str or bytes) as (generation, keys); None if malformed (the length is
    checked before anything is decoded: at most `MAX_DIGEST_KEYS` keys)."""
    if not isinstance(value, str | bytes) or len(value) > _SHARED_MAX:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    generation, _, keys = value.partition(" ")
    if not (generation.isascii() and generation.isdigit()) or len(generation) > 19:
        return None
    held = decode_digest(keys)
    return None if held is None else (int(generation), held)


def matched(keys: Sequence[bytes], held: frozenset[bytes] | set[bytes]) -> int:
    """How many of `keys`, from the first, `held` holds (the longest cached prefix, in keys)."""
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n
