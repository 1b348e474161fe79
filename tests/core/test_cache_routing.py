"""Cache-aware routing: a request's prefix keys, a replica's digest of what it holds, and the
choice by longest cached prefix within bounded load.

Driven through the routing table's own `pick` (what the gateway calls for every request), with
keys built from request bodies the way the gateway builds them (`prefix_keys`) and the replicas'
caches set as the health check sets them (`ReplicaCache.update` with a decoded digest).
"""

from __future__ import annotations

import time
from typing import Any

from modelyard.core import cache_routing
from modelyard.core.cache_routing import CacheHint
from modelyard.core.prefix_keys import (
    BLOCK_CHARS,
    MAX_DIGEST_KEYS,
    MAX_KEYS,
    PrefixKeys,
    decode_digest,
    encode_digest,
    from_header,
    matched,
    prefix_keys,
    to_header,
    token_ends,
)
from modelyard.core.routing import EndpointRoute, ReplicaRoute, RoutingTable

SYSTEM = "You are the assistant of a bank. " * 40  # ~1,300 characters: 5 full blocks


def endpoint(n: int, max_concurrency: int | None = None) -> EndpointRoute:
    route = EndpointRoute("ep-1", "t-1", "m", False, None, 4096)
    route.replicas = [
        ReplicaRoute(f"rep-{i}", f"http://127.0.0.1:{9000 + i}", max_concurrency=max_concurrency)
        for i in range(n)
    ]
    return route


def chat(system: str, user: str, salt: str = "tenant-a", **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": "m", "cache_salt": salt, "messages": messages, **extra}


def keys(payload: dict[str, Any]) -> PrefixKeys:
    k = prefix_keys(payload)
    assert k is not None
    return k


def hint(payload: dict[str, Any], factor: float = 1.0) -> CacheHint:
    return CacheHint(keys(payload), factor)


def holds(replica: ReplicaRoute, *payloads: dict[str, Any], generation: int = 1) -> None:
    """The replica's health report says its cache holds these requests' keys."""
    digest = encode_digest(k for p in payloads for k in keys(p).keys)
    held = decode_digest(digest)
    assert held is not None
    replica.cache.update(held, generation)


def test_keys_chain_the_rendered_prompt() -> None:
    a, b = keys(chat(SYSTEM, "hi")), keys(chat(SYSTEM, "what is my balance?"))
    shared = len(SYSTEM) // BLOCK_CHARS  # the blocks wholly inside the system prompt
    assert a.keys[:shared] == b.keys[:shared] and a.keys[-1] != b.keys[-1]
    assert matched(b.keys, frozenset(a.keys)) >= shared
    # The cache namespace, the model and the tools are part of the first block: no match.
    for other in (
        chat(SYSTEM, "hi", salt="tenant-b"),
        {**chat(SYSTEM, "hi"), "model": "m:adapter"},
        chat(SYSTEM, "hi", tools=[{"type": "function", "function": {"name": "f"}}]),
    ):
        assert matched(keys(other).keys, frozenset(a.keys)) == 0
    parts = [{"type": "text", "text": SYSTEM[:10]}, {"type": "text", "text": SYSTEM[10:]}]
    assert keys(chat(parts, "hi")) == a  # type: ignore[arg-type]
    # Long prompts: only the first MAX_KEYS blocks are keyed; the length is the whole one's.
    long = keys({"model": "m", "prompt": "x" * (BLOCK_CHARS * MAX_KEYS * 2)})
    assert len(long.keys) == MAX_KEYS and long.length > BLOCK_CHARS * MAX_KEYS * 2
    assert prefix_keys({"model": "m", "prompt": [1, 2, 3]}) is not None
    assert prefix_keys({"model": "m", "prompt": ["a", "b"]}) is None  # several prompts
    assert prefix_keys({"model": "m", "input": "embed me"}) is None


def test_header_and_digest_round_trip_and_are_bounded() -> None:
    k = keys(chat(SYSTEM, "hi"))
    assert from_header(to_header(k)) == k
    for bad in (None, "", "12", "x:AAAA", "5:not base64!", "5:" + "A" * 5000, "-1:AAAAAAAAAAA="):
        assert from_header(bad) is None
    many = [i.to_bytes(8, "big") for i in range(MAX_DIGEST_KEYS + 100)]
    held = decode_digest(encode_digest(many))
    assert held == frozenset(many[:MAX_DIGEST_KEYS])  # capped at MAX_DIGEST_KEYS
    assert decode_digest("A" * (MAX_DIGEST_KEYS * 12)) is None  # too long for a digest
    assert decode_digest("AAAA") is None and decode_digest(7) is None  # not whole keys
    # A key's tokens: proportional to its end in the rendering, never past the prompt.
    assert token_ends(PrefixKeys(k.keys[:2], 1000), 400) == [102, 204]
    assert token_ends(PrefixKeys(k.keys[:2], 300), 100) == [85, 100]


def test_goes_to_the_replica_holding_the_longest_prefix() -> None:
    route = endpoint(3)
    a, b, c = route.replicas
    holds(a, chat("another tenant's prompt " * 60, "q"))
    holds(b, chat(SYSTEM[: BLOCK_CHARS * 2], "q"))  # two blocks of the system prompt
    holds(c, chat(SYSTEM, "an earlier question"))  # all of it
    c.outstanding = 1
    a.outstanding = b.outstanding = 1
    assert RoutingTable.pick(route, prefix=hint(chat(SYSTEM, "a new question"))) is c
    # Nothing held anywhere: the least loaded.
    b.outstanding = 0
    assert RoutingTable.pick(route, prefix=hint(chat("a new tenant", "q"))) is b


def test_a_replica_past_its_load_bound_loses_the_affinity() -> None:
    def once(route: EndpointRoute, question: str, factor: float = 1.0) -> ReplicaRoute | None:
        """A pick judged by the reports alone (what it sends is forgotten again)."""
        chosen = RoutingTable.pick(route, prefix=hint(chat(SYSTEM, question), factor))
        for r in route.replicas:
            r.cache.pending.clear()
        return chosen

    route = endpoint(2)
    a, b = route.replicas
    holds(a, chat(SYSTEM, "q"))
    a.outstanding = 1  # b idle: cap = ceil(1.0 x 2 / 2) = 1, a is at it
    assert once(route, "q2") is b
    b.outstanding = 1  # equal loads: a's cache decides
    assert once(route, "q2") is a
    # A larger factor lets the holder take more than its share.
    a.outstanding, b.outstanding = 2, 1
    assert once(route, "q3", factor=1.5) is a
    assert once(route, "q3", factor=1.0) is b
    # A full replica is no candidate at all.
    route = endpoint(2, max_concurrency=1)
    a, b = route.replicas
    holds(a, chat(SYSTEM, "q"))
    a.outstanding = 1
    assert once(route, "q2") is b


def test_what_was_just_sent_counts_until_it_expires() -> None:
    route = endpoint(2)
    a, b = route.replicas
    first = RoutingTable.pick(route, prefix=hint(chat(SYSTEM, "q1")))
    assert first is not None
    other = b if first is a else a
    # No report yet: the replica just sent the prompt takes the next request sharing it...
    assert RoutingTable.pick(route, prefix=hint(chat(SYSTEM, "q2"))) is first
    # ...but a report from the other replica holding more of it wins.
    holds(other, chat(SYSTEM, "q3"))
    assert RoutingTable.pick(route, prefix=hint(chat(SYSTEM, "q3"))) is other
    # Sent keys expire: after PENDING_S only the reports count.
    stale = -cache_routing.PENDING_S - 1.0
    for key in list(first.cache.pending):
        first.cache.pending[key] += stale
    assert first.cache.matched(keys(chat(SYSTEM, "q4")).keys, time.monotonic()) == 0
    assert not first.cache.pending


def responses(instructions: str | None, given: Any, **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "cache_salt": "tenant-a", "input": given, **extra}
    return body if instructions is None else {**body, "instructions": instructions}


def test_responses_requests_are_keyed_as_the_chat_they_run_as() -> None:
    """The worker runs a Responses request as a chat (`worker/responses.py` `to_chat`): its keys
    are that chat's, so both APIs share a replica's cached prefix."""
    a = prefix_keys(responses(SYSTEM, "hi"), "responses")
    assert a == keys(chat(SYSTEM, "hi"))
    b = prefix_keys(responses(SYSTEM, "what is my balance?"), "responses")
    assert a is not None and b is not None
    shared = len(SYSTEM) // BLOCK_CHARS
    assert a.keys[:shared] == b.keys[:shared] and a.keys[-1] != b.keys[-1]
    # Items: text parts joined, a function call joins the assistant's turn, its output is a
    # tool message; function tools in chat's nested form.
    text = [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Paris?"}]
    items = [
        {"type": "message", "role": "user", "content": text},
        {"type": "message", "role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    schema = {"type": "object", "properties": {}}
    tool = {"type": "function", "name": "weather", "parameters": schema}
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    as_chat = {
        "model": "m",
        "cache_salt": "tenant-a",
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": schema}}],
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    }
    given = prefix_keys(responses(SYSTEM, items, tools=[tool]), "responses")
    assert given == keys(as_chat)
    # The calls are part of what the model reads: other arguments, another rendering.
    other = [*items[:2], {**items[2], "arguments": '{"city": "Lyon"}'}, items[3]]
    moved = prefix_keys(responses(SYSTEM, other, tools=[tool]), "responses")
    assert given is not None and moved is not None
    assert moved.keys[:shared] == given.keys[:shared] and moved != given
    # Nothing to key: no input items; an embeddings request's input is no prompt.
    assert prefix_keys(responses(None, []), "responses") is None
    assert prefix_keys({"model": "m", "input": "embed me"}, "embeddings") is None


def test_a_single_prompt_in_a_list_is_keyed_as_that_prompt() -> None:
    """The worker runs `["text"]` and `[[ids]]` as one prompt (and notes its keys) exactly as
    `"text"` and `[ids]`."""
    assert keys({"model": "m", "prompt": ["once upon"]}) == keys(
        {"model": "m", "prompt": "once upon"}
    )
    assert keys({"model": "m", "prompt": [[1, 2, 3]]}) == keys({"model": "m", "prompt": [1, 2, 3]})
