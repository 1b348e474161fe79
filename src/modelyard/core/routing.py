"""The routing table: which endpoints a tenant can address by model name, and their replicas.

Only the control plane writes it, through its verbs (`publish`, `remove`, `add_replica`,
`drop_replica`, `set_replicas`, `mark_unready`, `readmit`, `set_unavailable`,
`set_upstream_model`; each bumps `generation` and wakes waiting requests); the gateway reads it
on every request (`resolve`, `pick`) and may `bench` a replica it could not reach until the
control plane's next health check readmits it. `pick` chooses, among the ready replicas whose
circuit breaker lets requests through and which are below their admission limit, the one with
the fewest requests in flight. Requests that find every replica full wait in the endpoint's
`AdmissionQueue`, best tier first. When no replica serves and none will come up by waiting, the
control plane says why (`set_unavailable`), so requests fail at once instead of waiting for a
replica that is not coming. The gateway asks for a replica of an endpoint with none (scale from
zero) through an `Activate` callable the composition root hands it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from modelyard.core.breaker import CircuitBreaker


class Activate(Protocol):
    """Asks the control plane for a replica of an endpoint that has none (scale from zero)."""

    def __call__(self, endpoint_id: str) -> None: ...


@dataclass(eq=False)
class ReplicaRoute:
    replica_id: str
    url: str
    ready: bool = True
    outstanding: int = 0  # requests this gateway has in flight on it
    # Admission limit from the replica's KV cache capacity; None = unlimited.
    max_concurrency: int | None = None
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)

    def has_room(self) -> bool:
        return self.max_concurrency is None or self.outstanding < self.max_concurrency


@dataclass(eq=False)
class EndpointRoute:
    endpoint_id: str
    tenant_id: str
    model_name: str
    public: bool
    version_id: str | None
    max_tokens_cap: int
    replicas: list[ReplicaRoute] = field(default_factory=list)
    # The model's name on its replicas when it differs from the public one (the shared
    # encoder host knows each endpoint's model by the endpoint id).
    upstream_model: str | None = None
    # Filled into chat and completion requests that leave these sampling fields out.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    requests_total: int = 0
    last_request_at: float | None = None
    # Set by the control plane while no replica serves and none will come up by waiting (the
    # endpoint failed, or its replacement is still starting): a reason a tenant may read, and
    # when to retry. None while one serves, or while one is loading for a scale from zero.
    unavailable: str | None = None
    retry_after_s: int = 10
    queue: AdmissionQueue = field(default_factory=lambda: AdmissionQueue())
    _changed: asyncio.Event | None = None

    @property
    def waiting(self) -> int:
        """Requests queued for admission at the gateway."""
        return len(self.queue)

    @property
    def outstanding(self) -> int:
        return sum(r.outstanding for r in self.replicas)

    @property
    def ready_replicas(self) -> list[ReplicaRoute]:
        return [r for r in self.replicas if r.ready]

    def arrive(self) -> None:
        self.requests_total += 1
        self.last_request_at = time.monotonic()

    def release(self, replica: ReplicaRoute) -> None:
        """A request left `replica`: count it and wake one request waiting for room."""
        replica.outstanding -= 1
        self.notify()

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
        self.queue.wake_first()

    async def wait_change(self, at_most_s: float) -> None:
        """Until a replica frees a slot or the replica set changes, or `at_most_s` passes."""
        if self._changed is None:
            self._changed = asyncio.Event()
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), at_most_s)


# ----- the admission queue ---------------------------------------------------------------------

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
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.woken.wait(), at_most_s)
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


class RoutingTable:
    """Endpoints and their replicas: written by the control plane's verbs, read by the
    gateway."""

    def __init__(self) -> None:
        self.generation = 0
        self._endpoints: dict[str, EndpointRoute] = {}

    # ----- written by the control plane ---------------------------------------------------------

    def publish(self, route: EndpointRoute) -> None:
        """An endpoint becomes addressable (or its entry is replaced)."""
        self._endpoints[route.endpoint_id] = route
        self.generation += 1

    def remove(self, endpoint_id: str) -> EndpointRoute | None:
        """The endpoint takes no new requests; waiting ones are woken (to fail)."""
        self.generation += 1
        route = self._endpoints.pop(endpoint_id, None)
        if route is not None:
            route.notify()
        return route

    def add_replica(self, route: EndpointRoute, replica: ReplicaRoute) -> None:
        """A started, healthy replica joins the endpoint's routing."""
        route.replicas.append(replica)
        self._changed(route)

    def drop_replica(self, route: EndpointRoute, replica: ReplicaRoute) -> None:
        """A replica leaves the endpoint's routing (stopped, failed, drained)."""
        if replica in route.replicas:
            route.replicas.remove(replica)
            self._changed(route)

    def set_replicas(self, route: EndpointRoute, replicas: list[ReplicaRoute]) -> None:
        """The endpoint's replicas are exactly `replicas` (the shared encoder host's entry)."""
        route.replicas = list(replicas)
        self._changed(route)

    def mark_unready(self, replica: ReplicaRoute, route: EndpointRoute | None = None) -> bool:
        """No new requests for `replica` (draining, or its health check failed); requests in
        flight finish. False if it was out of routing already."""
        if not replica.ready:
            return False
        replica.ready = False
        self.generation += 1
        if route is not None:
            route.notify()
        return True

    def readmit(
        self, replica: ReplicaRoute, route: EndpointRoute | None = None, url: str | None = None
    ) -> bool:
        """`replica` takes requests again (its health check passed, or it restarted at `url`).
        False if nothing changed."""
        moved = url is not None and url != replica.url
        if replica.ready and not moved:
            return False
        if url is not None:
            replica.url = url
        replica.ready = True
        self.generation += 1
        if route is not None:
            route.notify()
        return True

    def set_unavailable(self, route: EndpointRoute, reason: str | None, retry_after_s: int) -> None:
        """Whether waiting can bring a replica: `reason` (for tenants) while none serves and
        none will come up by waiting, None otherwise; waiting requests are woken to re-check."""
        if (reason, retry_after_s) == (route.unavailable, route.retry_after_s):
            return
        route.unavailable, route.retry_after_s = reason, retry_after_s
        self._changed(route)

    def set_capacity(self, replica: ReplicaRoute, max_concurrency: int | None) -> None:
        """The replica's admission limit, from its KV cache capacity (its health report)."""
        if replica.max_concurrency != max_concurrency:
            replica.max_concurrency = max_concurrency
            self.generation += 1

    def set_version(self, route: EndpointRoute, version_id: str | None) -> None:
        """The registry version the endpoint now serves (a rollout or a rollback)."""
        route.version_id = version_id
        self.generation += 1

    def set_upstream_model(self, route: EndpointRoute, name: str | None) -> None:
        """The model's name on its replicas when it differs from the public one."""
        route.upstream_model = name
        self.generation += 1

    def _changed(self, route: EndpointRoute) -> None:
        self.generation += 1
        route.notify()

    # ----- read by the gateway ------------------------------------------------------------------

    def get(self, endpoint_id: str) -> EndpointRoute | None:
        return self._endpoints.get(endpoint_id)

    def visible(self, tenant_id: str) -> list[EndpointRoute]:
        """The tenant's own endpoints, then public ones whose name it does not shadow."""
        own = [e for e in self._endpoints.values() if e.tenant_id == tenant_id]
        names = {e.model_name for e in own}
        public = [
            e
            for e in self._endpoints.values()
            if e.public and e.tenant_id != tenant_id and e.model_name not in names
        ]
        return own + public

    def resolve(self, tenant_id: str, model: str) -> EndpointRoute | None:
        """By model name, or by endpoint id (`ep-…`), among what the tenant can see."""
        for route in self.visible(tenant_id):
            if model in (route.model_name, route.endpoint_id):
                return route
        return None

    @staticmethod
    def pick(route: EndpointRoute, exclude: set[str] | None = None) -> ReplicaRoute | None:
        now = time.monotonic()
        candidates = [
            r
            for r in route.replicas
            if r.ready
            and r.has_room()
            and r.breaker.available(now)
            and (not exclude or r.replica_id not in exclude)
        ]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda r: r.outstanding)
        chosen.breaker.on_send(now)
        return chosen

    @staticmethod
    def bench(replica: ReplicaRoute) -> None:
        """The gateway could not reach `replica`: no more requests until the control plane's
        next health check readmits it (the generation does not move: that is control's)."""
        replica.ready = False
