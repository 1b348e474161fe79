"""Prefix-aware routing: placement by prompt prefix, bounded load, fallback to least-loaded.

Driven through the routing table's own `pick` (what the gateway calls for every request), with
the hint built from request bodies the way the gateway builds it (`prefix_hint`).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from modelyard.core.prefix_affinity import PrefixHint, prefix_hint, render_prefix
from modelyard.core.routing import EndpointRoute, ReplicaRoute, RoutingTable


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


def hint(payload: dict[str, Any], factor: float = 1.25) -> PrefixHint:
    h = prefix_hint(payload, 2048, factor)
    assert h is not None
    return h


def pick(route: EndpointRoute, h: PrefixHint | None, hold: bool = False) -> ReplicaRoute:
    """One request: picked, and (unless `hold`) finished before the next."""
    r = RoutingTable.pick(route, prefix=h)
    assert r is not None
    if hold:
        r.outstanding += 1
    return r


def test_key_is_the_shared_leading_prompt() -> None:
    same = render_prefix(chat("You are a bank.", "hi"), 2048)
    assert same == render_prefix(chat("You are a bank.", "what is my balance?"), 2048)
    assert same != render_prefix(chat("You are a shop.", "hi"), 2048)
    assert same != render_prefix(chat("You are a bank.", "hi", salt="tenant-b"), 2048)  # cache
    assert same != render_prefix({**chat("You are a bank.", "hi"), "model": "m:adapter"}, 2048)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert same != render_prefix(chat("You are a bank.", "hi", tools=tools), 2048)
    # Without a system message the first message is the prefix; long prompts are cut.
    one = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
    assert render_prefix(one, 2048) == render_prefix(
        {"model": "m", "messages": [{"role": "user", "content": "x" * 6000}]}, 2048
    )
    text_parts = [{"type": "text", "text": "You are "}, {"type": "text", "text": "a bank."}]
    assert render_prefix(chat(text_parts, "hi"), 2048) == same  # type: ignore[arg-type]
    assert render_prefix({"model": "m", "prompt": "abc" * 2000}, 2048) is not None
    assert render_prefix({"model": "m", "prompt": [1, 2, 3]}, 2048) is not None
    assert render_prefix({"model": "m", "prompt": ["a", "b"]}, 2048) is None  # several prompts
    assert render_prefix({"model": "m", "input": "embed me"}, 2048) is None


def test_same_prefix_same_replica_and_prefixes_spread() -> None:
    route = endpoint(4)
    homes = {}
    for t in range(200):
        h = hint(chat(f"system prompt of tenant {t}", "q1"))
        first = pick(route, h)
        for q in range(3):  # later questions of the same tenant: the same replica
            assert pick(route, hint(chat(f"system prompt of tenant {t}", f"q{q}"))) is first
        homes[t] = first.replica_id
    spread = Counter(homes.values())
    assert set(spread) == {"rep-0", "rep-1", "rep-2", "rep-3"}
    assert min(spread.values()) >= 25  # roughly even (50 each expected)


def test_a_replica_leaving_moves_only_its_own_prefixes() -> None:
    route = endpoint(4)
    keys = [hint(chat(f"tenant {t}", "q")) for t in range(200)]
    before = [pick(route, h).replica_id for h in keys]
    route.replicas = [r for r in route.replicas if r.replica_id != "rep-2"]
    after = [pick(route, h).replica_id for h in keys]
    for b, a in zip(before, after, strict=True):
        assert a == b or b == "rep-2"
    assert "rep-2" not in after


def test_bounded_load_spills_a_hot_prefix() -> None:
    """Requests held in flight: no replica goes past ceil(factor x fair share) while another
    is below it; the hot prefix fills its replica to the bound, then spills."""
    route = endpoint(3)
    hot = hint(chat("one very popular system prompt", "q"), factor=1.25)
    home = RoutingTable.pick(route, prefix=hot)
    assert home is not None
    for n in range(1, 31):
        chosen = pick(route, hot, hold=True)
        loads = [r.outstanding for r in route.replicas]
        cap = math.ceil(1.25 * n / 3)
        assert max(loads) <= cap, (n, loads)
        assert sum(loads) == n
        if n <= 1:
            assert chosen is home
    assert home.outstanding == math.ceil(1.25 * 30 / 3)  # full to its bound: 13 of 30
    assert sorted(r.outstanding for r in route.replicas) == [4, 13, 13]  # next in rank, then
    # A factor of 2 lets the home replica take twice its share: with 3 replicas, 2 of the first
    # 2 requests and 4 of 6 (ceil(2 x 6/3) = 4), the rest spilled.
    route2 = endpoint(3)
    h2 = hint(chat("another prompt", "q"), factor=2.0)
    home2 = pick(route2, h2, hold=True)
    assert pick(route2, h2, hold=True) is home2
    assert pick(route2, h2, hold=True) is not home2
    for _ in range(3):
        pick(route2, h2, hold=True)
    assert home2.outstanding == 4 and sum(r.outstanding for r in route2.replicas) == 6


def test_fallbacks_full_tried_and_no_hint() -> None:
    route = endpoint(2, max_concurrency=1)
    h = hint(chat("prompt", "q"))
    home = pick(route, h, hold=True)
    other = pick(route, h, hold=True)  # home has no room: the other replica
    assert other is not home
    assert RoutingTable.pick(route, prefix=h) is None  # none has room: the caller waits
    home.outstanding = other.outstanding = 0
    assert RoutingTable.pick(route, exclude={home.replica_id}, prefix=h) is other  # retried
    home.ready = False  # out of routing: the prefix goes elsewhere
    assert pick(route, h) is other
    home.ready = True
    # No hint (embeddings, several prompts, or the setting off): least-loaded as before.
    route = endpoint(3)
    route.replicas[0].outstanding, route.replicas[1].outstanding = 3, 1
    route.replicas[2].outstanding = 2
    assert RoutingTable.pick(route) is route.replicas[1]
