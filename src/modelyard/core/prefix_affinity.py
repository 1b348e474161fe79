"""Prefix-aware replica choice: send a request where its prompt's prefix is likely cached.

Each replica's engine keeps a prefix cache of KV blocks; a request whose leading tokens another
request already computed on the same replica skips that prefill. With several replicas and
least-loaded routing, every replica ends up computing (and caching) every popular prefix, and
when the prefixes do not all fit, each replica keeps evicting them. Routing by prefix
partitions them instead.

The gateway has the request's messages, not its tokens, so the key is an approximation of "the
leading KV blocks": a hash of a canonical rendering of the part of the prompt requests share —
the model (an adapter has its own cache), the cache namespace (`cache_salt`: tenants never share
blocks), the tools, and the leading system/developer messages (else the first message; for a
completion, the prompt's start), cut at `chars` characters (≈ 4 per token). Two requests with
the same key share at least that prefix; requests whose system prompts differ only after the
cut share a key without sharing all their blocks.

Placement is rendezvous (highest random weight) hashing with bounded loads: replicas are ranked
by hash(key, replica id), so a key keeps its replica while the set changes (only the keys of a
replica that leaves or joins move), and the first in rank order whose requests in flight stay
within `load_factor` x its fair share (the mean over the usable replicas, counting this request)
takes it. A hot prefix therefore spills to its next replicas instead of overloading one; when
none qualifies, the caller falls back to the least-loaded replica.

A request for a tenant's registry LoRA adapter is keyed by the adapter instead
(`adapter_hint`), so each adapter's requests stay on the few replicas that hold it loaded.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import orjson


class Replica(Protocol):
    replica_id: str
    outstanding: int

    def has_room(self) -> bool: ...


R = TypeVar("R", bound=Replica)


@dataclass(frozen=True)
class PrefixHint:
    """A request's prefix key and how far past its fair share a replica may be loaded."""

    key: bytes
    load_factor: float = 1.25


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


def _leading_messages(messages: Sequence[Any]) -> Iterable[Any]:
    """The system/developer messages at the start; if none, the first message."""
    lead = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer"):
            break
        lead.append(m)
    return lead or messages[:1]


def render_prefix(payload: dict[str, Any], chars: int) -> str | None:
    """The canonical leading text of a chat or completion request (None: nothing to key on)."""
    head = f"{payload.get('model', '')}\x1d{payload.get('cache_salt') or ''}\x1d"
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        tools = payload.get("tools")
        body = orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode() if tools else ""
        for m in _leading_messages(messages):
            if isinstance(m, dict):
                body += f"\x1e{m.get('role', '')}\x1f{_text(m.get('content'))}"
        return head + body[:chars]
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):  # token ids
        return head + ",".join(map(str, prompt[: max(1, chars // 4)]))
    if isinstance(prompt, str) and prompt:
        return head + prompt[:chars]
    return None  # several prompts in one request, embeddings, …: least-loaded


def prefix_hint(payload: dict[str, Any], chars: int, load_factor: float) -> PrefixHint | None:
    rendered = render_prefix(payload, chars)
    if rendered is None:
        return None
    key = hashlib.blake2b(rendered.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return PrefixHint(key, load_factor)


def adapter_hint(name: str, load_factor: float) -> PrefixHint:
    """A registry adapter's requests keyed by the adapter alone: they go to the replicas that
    already hold it in a slot (rendezvous order, bounded load), spilling to the next ones."""
    key = hashlib.blake2b(b"adapter\x1d" + name.encode(), digest_size=16).digest()
    return PrefixHint(key, load_factor)


def _weight(key: bytes, replica_id: str) -> int:
    digest = hashlib.blake2b(replica_id.encode(), digest_size=8, key=key[:16]).digest()
    return int.from_bytes(digest, "big")


def choose(hint: PrefixHint, candidates: Sequence[R], usable: Sequence[R]) -> R | None:
    """The highest-ranked of `candidates` (replicas with room) within its bounded share of
    the load over `usable` (every replica that could serve); None: fall back to least-loaded."""
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    total = sum(r.outstanding for r in usable) + 1  # with this request
    cap = math.ceil(hint.load_factor * total / max(1, len(usable)))
    ranked = sorted(candidates, key=lambda r: _weight(hint.key, r.replica_id), reverse=True)
    return next((r for r in ranked if r.outstanding < cap), None)
