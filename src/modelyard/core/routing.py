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
import contextlib
import time
from dataclasses import dataclass, field
from typing import Protocol

from modelyard.core.admission import AdmissionQueue
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
