"""Adapter-aware replica choice: a tenant's registry LoRA adapter's requests go to the few
replicas that already hold it loaded in a slot.

The key is the adapter's internal name. Placement is rendezvous (highest random weight) hashing
with bounded loads: replicas are ranked by hash(key, replica id), so an adapter keeps its
replicas while the set changes (only the keys of a replica that leaves or joins move), and the
first in rank order whose requests in flight stay within `load_factor` x its fair share (the mean
over the usable replicas, counting this request) takes it. A hot adapter therefore spills to its
next replicas instead of overloading one; when none qualifies, the caller falls back to the
least-loaded replica. (Requests without an adapter are routed by what each replica's prefix cache
holds: `core/cache_routing.py`.)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class Replica(Protocol):
    replica_id: str
    outstanding: int


R = TypeVar("R", bound=Replica)


def _weight(key: bytes, replica_id: str) -> int:
    digest = hashlib.blake2b(replica_id.encode(), digest_size=8, key=key[:16]).digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True)
class AdapterHint:
    """An adapter's key and how far past its fair share a replica may be loaded."""

    key: bytes
    load_factor: float = 1.25

    def choose(self, candidates: Sequence[R], usable: Sequence[R]) -> R | None:
        """The highest-ranked of `candidates` (replicas with room) within its bounded share of
        the load over `usable` (every replica that could serve); None: fall back to
        least-loaded."""
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        total = sum(r.outstanding for r in usable) + 1  # with this request
        cap = math.ceil(self.load_factor * total / max(1, len(usable)))
        ranked = sorted(candidates, key=lambda r: _weight(self.key, r.replica_id), reverse=True)
        return next((r for r in ranked if r.outstanding < cap), None)

    def sent(self, replica: Replica) -> None:
        """Nothing to note: the adapter's placement is its hash's."""


def adapter_hint(name: str, load_factor: float) -> AdapterHint:
    """A registry adapter's requests keyed by the adapter alone: they go to the replicas that
    already hold it in a slot (rendezvous order, bounded load), spilling to the next ones."""
    key = hashlib.blake2b(b"adapter\x1d" + name.encode(), digest_size=16).digest()
    return AdapterHint(key, load_factor)
