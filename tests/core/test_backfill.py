"""Backfill in the replica choice: a batch item goes only to a replica that may take it (more
free slots than the reserved ones and the KV one item needs, as its last report gave them, less
what was sent since; below its admission limit counting batch items), preferring among those as
an interactive request would (prefix cache, adapter, least loaded); None when none may (the
gateway then waits, `tests/batch/test_backfill_choice.py`). An interactive request's choice is
the one it was.

Driven through the routing table's own `pick` with the real routes, the hints built the way the
gateway builds them, and the rule the platform's settings give (`Backfill.of`).
"""

from __future__ import annotations

from modelyard.config import PlatformSettings
from modelyard.core.adapter_affinity import adapter_hint
from modelyard.core.backfill import Backfill
from modelyard.core.cache_routing import CacheHint
from modelyard.core.prefix_keys import decode_digest, encode_digest, prefix_keys
from modelyard.core.routing import CapacityReport, EndpointRoute, ReplicaRoute, RoutingTable

RULE = Backfill.of(PlatformSettings(backfill_reserved_slots=1, admission_tokens_per_request=100))
ROOM = CapacityReport(free_slots=6, kv_free_tokens=10_000, outstanding=0)
RESERVED_ONLY = CapacityReport(free_slots=1, kv_free_tokens=10_000, outstanding=0)
NO_KV = CapacityReport(free_slots=6, kv_free_tokens=99, outstanding=0)
PROMPT = {
    "model": "m",
    "cache_salt": "tenant-a",
    "messages": [
        {"role": "system", "content": "You are the assistant of a bank. " * 40},
        {"role": "user", "content": "what is my balance?"},
    ],
}


def replica(name: str, report: CapacityReport | None, outstanding: int = 0) -> ReplicaRoute:
    r = ReplicaRoute(name, f"http://{name}.invalid", max_concurrency=8, outstanding=outstanding)
    if report is not None:  # what it reported with this process's requests then in flight
        r.report = CapacityReport(report.free_slots, report.kv_free_tokens, outstanding)
    return r


def endpoint(*replicas: ReplicaRoute) -> EndpointRoute:
    return EndpointRoute("ep-1", "t-1", "m", False, None, 4096, replicas=list(replicas))


def cache_hint() -> CacheHint:
    keys = prefix_keys(PROMPT)
    assert keys is not None
    return CacheHint(keys, 1.0)


def holds_prompt(r: ReplicaRoute) -> None:
    """Its health report says its prefix cache holds the prompt's blocks."""
    keys = prefix_keys(PROMPT)
    assert keys is not None
    held = decode_digest(encode_digest(keys.keys))
    assert held is not None
    r.cache.update(held, 1)


def test_the_settings_give_the_rule() -> None:
    assert (RULE.kv_per_item, RULE.reserved_slots) == (100, 1)


def test_a_batch_item_skips_the_least_loaded_replica_when_it_has_no_room() -> None:
    for full in (RESERVED_ONLY, NO_KV):
        idle, busy = replica("idle", full), replica("busy", ROOM, outstanding=3)
        route = endpoint(idle, busy)
        assert RoutingTable.pick(route) is idle  # interactive: the least loaded, as before
        assert RoutingTable.pick(route, backfill=RULE) is busy


def test_what_was_sent_since_the_report_counts() -> None:
    # It reported six free slots; since, this process sent it five requests: one slot left,
    # and it is the reserved one.
    r = replica("r", ROOM)
    r.outstanding = 5
    assert RoutingTable.pick(endpoint(r), backfill=RULE) is None
    r.outstanding = 4  # one finished
    assert RoutingTable.pick(endpoint(r), backfill=RULE) is r


def test_a_batch_item_skips_the_replica_holding_its_prefix_when_it_has_no_room() -> None:
    holder, other = replica("holder", RESERVED_ONLY), replica("other", ROOM)
    holds_prompt(holder)
    route = endpoint(holder, other)
    assert RoutingTable.pick(route, prefix=cache_hint()) is holder  # interactive: its cache
    assert RoutingTable.pick(route, prefix=cache_hint(), backfill=RULE) is other


def test_among_the_replicas_with_room_the_prefix_cache_still_decides() -> None:
    full = replica("full", RESERVED_ONLY, outstanding=3)
    spare, warm = replica("spare", ROOM), replica("warm", ROOM, outstanding=1)
    holds_prompt(full)
    holds_prompt(warm)
    route = endpoint(full, spare, warm)
    assert RoutingTable.pick(route, backfill=RULE) is spare  # no hint: the least loaded
    assert RoutingTable.pick(route, prefix=cache_hint(), backfill=RULE) is warm


def test_a_batch_item_skips_its_adapters_replica_when_it_has_no_room() -> None:
    a, b = replica("rep-a", ROOM), replica("rep-b", ROOM)
    hint = adapter_hint("tn-1.adapter", 1.25)
    home = RoutingTable.pick(endpoint(a, b), prefix=hint)
    assert home is not None
    assert RoutingTable.pick(endpoint(a, b), prefix=hint, backfill=RULE) is home
    home.report = RESERVED_ONLY
    other = b if home is a else a
    assert RoutingTable.pick(endpoint(a, b), prefix=hint) is home  # interactive: unchanged
    assert RoutingTable.pick(endpoint(a, b), prefix=hint, backfill=RULE) is other


def test_no_replica_with_room_is_no_choice() -> None:
    route = endpoint(replica("a", RESERVED_ONLY), replica("b", NO_KV, outstanding=1))
    assert RoutingTable.pick(route, backfill=RULE) is None  # the caller waits
    assert RoutingTable.pick(route) is route.replicas[0]  # interactive requests go on


def test_an_engine_that_reports_nothing_has_its_admission_limit_alone() -> None:
    quiet = replica("quiet", None, outstanding=7)
    quiet.batch_outstanding = 7
    route = endpoint(quiet)
    assert RoutingTable.pick(route, backfill=RULE) is quiet
    quiet.outstanding = quiet.batch_outstanding = 8  # full, of batch items
    assert RoutingTable.pick(route, backfill=RULE) is None
    assert RoutingTable.pick(route) is quiet  # batch items never hold an interactive one back
