"""The routing table: which endpoints a tenant can address by model name, and their replicas.

The control plane writes it (each change bumps `generation`); the gateway reads it on every
request and picks, among the ready replicas whose circuit breaker lets requests through and
which are below their admission limit, the one with the fewest requests in flight. Requests that
find every replica full wait on the endpoint's `changed` signal (the admission queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from modelyard.gateway.breaker import CircuitBreaker


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
    waiting: int = 0  # requests queued for admission at the gateway
    requests_total: int = 0
    last_request_at: float | None = None
    # Asks the control plane for a replica when there is none (scale from zero).
    activate: Callable[[], None] | None = None
    _changed: asyncio.Event | None = None

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

    async def wait_change(self, at_most_s: float) -> None:
        """Until a replica frees a slot or the replica set changes, or `at_most_s` passes."""
        if self._changed is None:
            self._changed = asyncio.Event()
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), at_most_s)


class RoutingTable:
    def __init__(self) -> None:
        self.generation = 0
        self._endpoints: dict[str, EndpointRoute] = {}

    def put(self, route: EndpointRoute) -> None:
        self._endpoints[route.endpoint_id] = route
        self.generation += 1

    def remove(self, endpoint_id: str) -> EndpointRoute | None:
        self.generation += 1
        route = self._endpoints.pop(endpoint_id, None)
        if route is not None:
            route.notify()
        return route

    def get(self, endpoint_id: str) -> EndpointRoute | None:
        return self._endpoints.get(endpoint_id)

    def changed(self, route: EndpointRoute) -> None:
        """The control plane added, removed or re-admitted replicas of `route`."""
        self.generation += 1
        route.notify()

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
