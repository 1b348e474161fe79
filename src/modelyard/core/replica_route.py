"""One replica as the gateway routes to it: its address, whether it takes requests, what this
process has in flight on it (batch items counted apart), its admission limit, its circuit
breaker, the free capacity its last health report gave (backfill reads it) and the prefix
blocks it holds (cache-aware routing reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from modelyard.core.breaker import CircuitBreaker
from modelyard.core.cache_routing import ReplicaCache


@dataclass(frozen=True)
class CapacityReport:
    """A replica's free capacity in its last health report (its engine's sequence slots and KV
    tokens no sequence holds), with this process's requests in flight on it at that moment."""

    free_slots: int
    kv_free_tokens: int
    outstanding: int
    kv_capacity_tokens: int = 1 << 40  # the whole cache (a request never needs more)


@dataclass(eq=False)
class ReplicaRoute:
    replica_id: str
    url: str
    ready: bool = True
    outstanding: int = 0  # requests this gateway has in flight on it
    # Of those, batch items: the engine preempts them for interactive requests, so they never
    # count against an interactive request's admission.
    batch_outstanding: int = 0
    report: CapacityReport | None = None  # free capacity (engines that report it)
    # Admission limit from the replica's KV cache capacity; None = unlimited.
    max_concurrency: int | None = None
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    version_id: str | None = None  # the registry version it serves
    cache: ReplicaCache = field(default_factory=ReplicaCache)  # what its prefix cache holds

    def usable(self, now: float, exclude: set[str] | None) -> bool:
        """In routing, its breaker lets requests through, and this request has not tried it."""
        return (
            self.ready
            and self.breaker.available(now)
            and (not exclude or self.replica_id not in exclude)
        )

    def has_room(self, batch: bool = False) -> bool:
        """Below its admission limit: counting every request for a batch item, only the
        interactive ones for an interactive request."""
        if self.max_concurrency is None:
            return True
        used = self.outstanding if batch else self.outstanding - self.batch_outstanding
        return used < self.max_concurrency

    def free_capacity(self, kv_per_request: int) -> tuple[int, int] | None:
        """(free slots, free KV tokens) now, estimated from its last report: each request this
        process sent since takes a slot and `kv_per_request` tokens, each one finished since
        gives them back. None: its engine does not report them."""
        r = self.report
        if r is None:
            return None
        sent = self.outstanding - r.outstanding
        kv_per_request = min(kv_per_request, r.kv_capacity_tokens)
        return r.free_slots - sent, r.kv_free_tokens - sent * kv_per_request
