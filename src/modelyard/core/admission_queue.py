"""The admission queue: requests waiting for a replica with room, best tier first.

Each endpoint's route holds one (`core.routing.EndpointRoute.queue`); the gateway joins it when
every replica is full and leaves it when admitted, timed out or refused.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

# Ranks: 0 = priority, 1 = standard, 2 = free (`Tier.rank`); batch items after all of them.
DEFAULT_RANK = 1
BATCH_RANK = 3
# The share of `admission_queue_size` that requests of a rank may fill: a free request is
# refused (429) once the queue is half full, a standard one at 80 %, a priority one only when
# it is full of priority requests. Past its share a request may still enter by taking the place
# of the newest waiter of a worse rank, which is refused instead: under overload the lower tier
# gets 429 first, and the better tiers keep room to wait.
QUEUE_SHARES = {0: 1.0, 1: 0.8, 2: 0.5, BATCH_RANK: 0.5}


def admission_rank(tier: Any, batch: bool = False) -> int:
    """A request's place in the queue: its tenant's tier rank, batch items last. `tier` is the
    principal's `Tier` (anything with an int `rank`); None (unknown) counts as standard."""
    if batch:
        return BATCH_RANK
    rank = getattr(tier, "rank", None)
    return rank if isinstance(rank, int) else DEFAULT_RANK


class AdmissionRefused(Exception):
    """A request may not wait for room: the queue is full for its rank, or a request of a
    better rank took its place."""


@dataclass(eq=False)
class Waiter:
    rank: int
    seq: int
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    refused: str | None = None  # set when a better-ranked request displaced it

    @property
    def key(self) -> tuple[int, int]:
        return (self.rank, self.seq)

    async def wait(self, at_most_s: float) -> None:
        """Until woken (a slot may be free for it, or it was refused) or `at_most_s` passes."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation
        # that arrives just after the event was set, leaving a cancelled request waiting.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(at_most_s):
                await self.woken.wait()
        self.woken.clear()


class AdmissionQueue:
    """Requests waiting for a replica with room: served best rank first, then by arrival.

    Only the first waiter may take a free slot, and a new request may take one only if it ranks
    before every waiter, so nobody overtakes a better or earlier request. When a slot frees
    (`wake_first`), the first waiter is woken; when it leaves (admitted, timed out or refused)
    the next one is woken, so several free slots fill one after another.
    """

    def __init__(self) -> None:
        self._waiters: list[Waiter] = []  # sorted by (rank, seq)
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    def may_take(self, rank: int, waiter: Waiter | None = None) -> bool:
        """Whether a request may take a free slot now: it is the first waiter, or (not queued)
        it ranks strictly before every waiter."""
        if not self._waiters:
            return True
        first = self._waiters[0]
        return first is waiter if waiter is not None else rank < first.rank

    def join(self, rank: int, size: int) -> Waiter:
        """Queue a request of `rank` in a queue of `size`; raises `AdmissionRefused` when it
        may not wait."""
        share = QUEUE_SHARES.get(rank, QUEUE_SHARES[BATCH_RANK])
        limit = size if rank == 0 else int(size * share)
        if len(self._waiters) >= min(limit, size):
            victim = self._waiters[-1] if self._waiters else None
            if victim is None or victim.rank <= rank:
                raise AdmissionRefused(
                    "the admission queue is full"
                    if len(self._waiters) >= size
                    else "the admission queue is kept for higher tiers"
                )
            # The newest waiter of the worst rank makes room for this better-ranked request.
            self._waiters.pop()
            victim.refused = "a higher tier took its place in the admission queue"
            victim.woken.set()
        waiter = Waiter(rank, next(self._seq))
        bisect.insort(self._waiters, waiter, key=lambda w: w.key)
        return waiter

    def leave(self, waiter: Waiter) -> None:
        """The request stops waiting: admitted, timed out or gone; the next one gets its turn."""
        was_first = bool(self._waiters) and self._waiters[0] is waiter
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if was_first:
            self.wake_first()

    def wake_first(self) -> None:
        if self._waiters:
            self._waiters[0].woken.set()
