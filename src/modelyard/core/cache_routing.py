"""Cache-aware replica choice: send a request to the replica that holds the longest cached prefix
of its prompt, unless that replica is loaded past its bound.

What each replica holds comes from its own engine: its health report carries a digest of the
prefix keys (`core/prefix_keys.py`) whose KV blocks are still in its prefix cache, which the
control plane's health check hands to the routing table (`ReplicaCache.update`; in cluster mode
the leader's, which shares it with every gateway through Redis: `control/digest_publisher.py`,
`gateway/digest_mirror.py`). Between two reports (a health check every few seconds) the gateway
also counts what it has just sent: the keys of a request routed to a replica are taken as held
there for `PENDING_S` seconds (its prefill writes them), so a burst of one prompt does not
scatter before the next report. The report stays the judge: a key the replica evicted leaves
its next digest.

The choice (`CacheHint.choose`): among the replicas with room, those within their load bound —
requests in flight below `load_factor` x the fair share (the mean over the usable replicas,
counting this request), rounded up — and of them the one whose cache matches the most leading
keys; ties, and a request no replica within bound holds any of, go to the least loaded. A
replica past its bound loses its affinity: at load factor 1 with two replicas, a replica takes a
request it holds only while it has no more requests in flight than the other.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from modelyard.core.prefix_keys import PrefixKeys, matched, to_header

PENDING_S = 30.0  # how long keys sent to a replica count as held without its report
MAX_PENDING = 4096  # keys sent and not yet reported, per replica


@dataclass(eq=False)
class ReplicaCache:
    """What the gateway knows of one replica's prefix cache: its last digest and what was sent
    to it since."""

    held: frozenset[bytes] = frozenset()
    generation: int = -1  # the digest's, as the replica numbered it (-1: none yet)
    pending: OrderedDict[bytes, float] = field(default_factory=OrderedDict)

    def update(self, held: frozenset[bytes], generation: int) -> None:
        """The replica's latest digest."""
        self.held, self.generation = held, generation

    def sent(self, keys: Sequence[bytes], now: float) -> None:
        """A request with these keys was routed here: they count as held for `PENDING_S`."""
        for key in keys:
            self.pending[key] = now
            self.pending.move_to_end(key)
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)

    def matched(self, keys: Sequence[bytes], now: float) -> int:
        """How many of the request's leading keys this replica holds (or was just sent)."""
        while self.pending:
            key, at = next(iter(self.pending.items()))
            if now - at <= PENDING_S:
                break
            del self.pending[key]
        n = matched(keys, self.held)
        for key in keys[n:]:
            if key not in self.pending:
                break
            n += 1
        return n


class Replica(Protocol):
    replica_id: str
    outstanding: int
    cache: ReplicaCache


R = TypeVar("R", bound=Replica)


@dataclass(frozen=True)
class CacheHint:
    """A request's prefix keys and how far past its fair share a replica keeps its affinity."""

    prefix: PrefixKeys
    load_factor: float = 1.0

    @property
    def keys(self) -> tuple[bytes, ...]:
        return self.prefix.keys

    def header(self) -> str:
        """The keys for the replica (`prefix_keys.HEADER`): it ties them to its KV blocks."""
        return to_header(self.prefix)

    def choose(self, candidates: Sequence[R], usable: Sequence[R]) -> R | None:
        """The replica of `candidates` (those with room) within its load bound over `usable`
        that holds the longest prefix (ties: the least loaded); None: none holds any within
        bound, so the caller's least-loaded choice stands."""
        if len(candidates) < 2:
            return candidates[0] if candidates else None
        total = sum(r.outstanding for r in usable) + 1  # with this request
        cap = math.ceil(self.load_factor * total / max(1, len(usable)))
        now = time.monotonic()
        best: R | None = None
        best_key = (0, 0)
        for r in candidates:
            if r.outstanding >= cap:
                continue
            n = r.cache.matched(self.keys, now)
            if n and (best is None or (n, -r.outstanding) > best_key):
                best, best_key = r, (n, -r.outstanding)
        return best

    def sent(self, replica: Replica) -> None:
        replica.cache.sent(self.keys, time.monotonic())
