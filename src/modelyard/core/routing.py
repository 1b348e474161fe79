"""The routing table: which endpoints a tenant can address by model name, and their replicas.

Only the control plane writes it, through its verbs (`publish`, `remove`, `add_replica`,
`drop_replica`, `set_replicas`, `mark_unready`, `readmit`, `set_unavailable`,
`set_upstream_model`, `set_weights`; each bumps `generation` and wakes waiting requests); the
gateway reads it on every request (`resolve`, `pick`) and may `bench` a replica it could not
reach until the control plane's next health check readmits it. `pick` chooses, among the ready
replicas whose circuit breaker lets requests through and which are below their admission limit
(for a batch item: which may take it, `core/backfill.py`), the one with the fewest requests in
flight. An endpoint serving several versions (a canary beside the stable one) carries their
traffic weights: `pick` first draws the version (sticky by the request's affinity key: the same
`user` or session lands on the same version while the weights stay), then the replica among that
version's; only when the drawn version has no replica that could take a request does another
version serve it (counted in `fallbacks`). Requests that find every replica full wait in the
endpoint's `AdmissionQueue`, best tier first (batch items wait apart, `gateway/upstream.py`).
When no replica serves and none will come up by waiting, the control plane says why
(`set_unavailable`), so requests fail at once instead of waiting for a replica that is not
coming. The gateway asks for a replica of an endpoint with none (scale from zero) through an
`Activate` callable the composition root hands it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from modelyard.core.adapter_affinity import AdapterHint
from modelyard.core.adapter_routes import AdapterIndex, AdapterMap, drop_from
from modelyard.core.admission_queue import AdmissionQueue
from modelyard.core.backfill import Backfill
from modelyard.core.cache_routing import CacheHint
from modelyard.core.replica_route import CapacityReport, ReplicaRoute

__all__ = [
    "Activate",
    "CapacityReport",
    "EndpointRoute",
    "ReadVersionStats",
    "ReplicaRoute",
    "RoutingTable",
    "VersionWindow",
    "affinity_bucket",
]


class Activate(Protocol):
    """Asks the control plane for a replica of an endpoint that has none (scale from zero)."""

    def __call__(self, endpoint_id: str) -> None: ...


@dataclass(frozen=True)
class VersionWindow:
    """What the gateway saw of one version of an endpoint over a recent window: requests
    answered, of which failed (a 5xx from the replica, a timeout, a broken connection), and the
    95th percentile latency of the good ones (time to first token for streams)."""

    samples: int = 0
    errors: int = 0
    p95_s: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.samples if self.samples else 0.0


class ReadVersionStats(Protocol):
    """The gateway's verb the control plane reads a version's recent outcomes through (the
    canary's SLO gate), handed to it by the composition root."""

    def __call__(self, endpoint_id: str, version_id: str, window_s: float) -> VersionWindow: ...


def affinity_bucket(key: str) -> int:
    """A stable bucket 0..99 for an affinity key (a request's `user` or session id)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100


@dataclass(eq=False)
class EndpointRoute:
    endpoint_id: str
    tenant_id: str
    model_name: str
    public: bool
    version_id: str | None  # the stable version
    max_tokens_cap: int
    replicas: list[ReplicaRoute] = field(default_factory=list)
    # The model's name on its replicas when it differs from the public one (the shared
    # encoder host knows each endpoint's model by the endpoint id).
    upstream_model: str | None = None
    # Filled into chat and completion requests that leave these sampling fields out.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # Percent of requests per version while several serve (a canary): empty or one entry means
    # every ready replica takes requests whatever its version (a plain rollout).
    weights: dict[str, int] = field(default_factory=dict)
    fallbacks: int = 0  # requests served by another version: the drawn one had no usable replica
    requests_total: int = 0
    last_request_at: float | None = None
    # Set by the control plane while no replica serves and none will come up by waiting (the
    # endpoint failed, or its replacement is still starting): a reason a tenant may read, and
    # when to retry. None while one serves, or while one is loading for a scale from zero.
    unavailable: str | None = None
    retry_after_s: int = 10
    # Registry LoRA adapters its replicas serve, of every tenant (`core/adapter_routes.py`).
    adapters: AdapterMap = field(default_factory=dict)
    lora_dir: bool = False  # its engine has a `lora_dir`: `<model>:<name>` may name one there
    model_kind: str | None = None  # core/model_kinds.py's ModelKind; None until provisioned
    capabilities: dict[str, Any] = field(default_factory=dict)  # what /v1/models shows
    queue: AdmissionQueue = field(default_factory=lambda: AdmissionQueue())
    # Cluster mode, on the controller: requests queued at the gateways (summed from Redis).
    remote_waiting: int = 0
    _changed: asyncio.Event | None = None

    @property
    def waiting(self) -> int:
        """Requests queued for admission at the gateway (at every gateway, on a controller)."""
        return len(self.queue) + self.remote_waiting

    @property
    def outstanding(self) -> int:
        # A plain loop: the controller reads this for every endpoint each tick.
        n = 0
        for r in self.replicas:
            n += r.outstanding
        return n

    @property
    def ready_replicas(self) -> list[ReplicaRoute]:
        return [r for r in self.replicas if r.ready]

    def arrive(self) -> None:
        self.requests_total += 1
        self.last_request_at = time.monotonic()

    def release(self, replica: ReplicaRoute, batch: bool = False) -> None:
        """A request left `replica`: count it and wake one request waiting for room."""
        replica.outstanding -= 1
        if batch:
            replica.batch_outstanding -= 1
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
        # `resolve` looks only at the endpoints that can answer: the tenant's own under the name,
        # then the public ones under it. Not every tenant's under the name: thousands of
        # tenants may each deploy the same model name.
        self._own: dict[tuple[str, str], list[EndpointRoute]] = {}  # (tenant, model name)
        self._public: dict[str, list[EndpointRoute]] = {}  # model name -> public endpoints
        self._order: dict[str, int] = {}  # endpoint id -> when first published (table order)
        self._published = 0
        self.adapter_index: AdapterIndex[EndpointRoute] = AdapterIndex()  # tenants' adapters

    # ----- written by the control plane ---------------------------------------------------------

    def publish(self, route: EndpointRoute) -> None:
        """An endpoint becomes addressable (or its entry is replaced)."""
        self._unindex(self._endpoints.get(route.endpoint_id))
        if route.endpoint_id not in self._endpoints:
            self._published += 1
            self._order[route.endpoint_id] = self._published
        self._endpoints[route.endpoint_id] = route
        self.adapter_index.add(route)
        self._own.setdefault((route.tenant_id, route.model_name), []).append(route)
        if route.public:
            self._public.setdefault(route.model_name, []).append(route)
        self.generation += 1

    def remove(self, endpoint_id: str) -> EndpointRoute | None:
        """The endpoint takes no new requests; waiting ones are woken (to fail)."""
        self.generation += 1
        route = self._endpoints.pop(endpoint_id, None)
        if route is not None:
            self._unindex(route)
            del self._order[endpoint_id]
            route.notify()
        return route

    def _unindex(self, route: EndpointRoute | None) -> None:
        if route is None:
            return
        drop_from(self._own, (route.tenant_id, route.model_name), route)
        drop_from(self._public, route.model_name, route)
        self.adapter_index.drop(route)

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

    def set_report(
        self, route: EndpointRoute, replica: ReplicaRoute, report: CapacityReport | None
    ) -> None:
        """The replica's free capacity as its health report gives it (held-back batch items
        look again)."""
        replica.report = report
        if route._changed is not None:
            route._changed.set()

    def set_capacity(self, replica: ReplicaRoute, max_concurrency: int | None) -> None:
        """The replica's admission limit, from its KV cache capacity (its health report)."""
        if replica.max_concurrency != max_concurrency:
            replica.max_concurrency = max_concurrency
            self.generation += 1

    def set_version(self, route: EndpointRoute, version_id: str | None) -> None:
        """The registry version the endpoint now serves (a rollout or a rollback)."""
        route.version_id = version_id
        self.generation += 1

    def set_weights(self, route: EndpointRoute, weights: dict[str, int]) -> None:
        """The traffic split over the endpoint's versions (percent; a canary, a promotion, a
        rollback): requests picked from here on follow it at once."""
        route.weights = dict(weights)
        self._changed(route)

    def set_adapters(self, route: EndpointRoute, adapters: AdapterMap) -> None:
        """The registry adapters the endpoint serves (their tenants may name them)."""
        if self._endpoints.get(route.endpoint_id) is not route:
            route.adapters = adapters
        elif self.adapter_index.set(route, adapters):
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

    def all_routes(self) -> list[EndpointRoute]:
        """Every endpoint (cluster mode: a gateway's load report, the controller's sums)."""
        return list(self._endpoints.values())

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
        """By model name, or by endpoint id (`ep-…`), among what the tenant can see (as
        `visible` orders it: the tenant's own first, then public ones it does not shadow)."""
        own = list(self._own.get((tenant_id, model), ()))
        by_id = self._endpoints.get(model)
        if by_id is not None and by_id.tenant_id == tenant_id:
            own.append(by_id)
        if own:  # the first published, as the table's order would have it
            return min(own, key=self._first) if len(own) > 1 else own[0]
        public = list(self._public.get(model, ()))
        if by_id is not None and by_id.public and not self._shadowed(tenant_id, by_id):
            public.append(by_id)
        if not public:
            return None
        return min(public, key=self._first) if len(public) > 1 else public[0]

    def _shadowed(self, tenant_id: str, route: EndpointRoute) -> bool:
        """The tenant has an endpoint of its own under this public endpoint's model name."""
        return (tenant_id, route.model_name) in self._own

    def _first(self, route: EndpointRoute) -> int:
        # The table's order (a dict keeps a replaced entry where it was first published).
        return self._order[route.endpoint_id]

    @staticmethod
    def pick(
        route: EndpointRoute,
        exclude: set[str] | None = None,
        affinity: str | None = None,
        prefix: CacheHint | AdapterHint | None = None,
        backfill: Backfill | None = None,
    ) -> ReplicaRoute | None:
        """The least-loaded replica with room, of the version drawn by weight (see the module's
        docstring), or with a `prefix` hint the one holding the longest cached prefix of the
        prompt (`core/cache_routing.py`) or the request's adapter (`core/adapter_affinity.py`),
        within bounded load; None while none has room (the caller waits) or every one was
        tried. A batch item (`backfill`) has room only where `backfill.room` says so."""
        now = time.monotonic()
        usable = [r for r in route.replicas if r.usable(now, exclude)]
        if len(route.weights) > 1 or (
            route.weights and any(r.version_id not in route.weights for r in usable)
        ):
            version = RoutingTable.draw_version(route.weights, affinity)
            own = [r for r in usable if r.version_id == version]
            if own:
                usable = own
            else:  # the drawn version cannot serve now: another one does, counted
                # Never one at weight 0: a rolled-back canary, a previous version kept warm.
                usable = [r for r in usable if route.weights.get(r.version_id or "", 0) > 0]
                if usable:
                    route.fallbacks += 1
        candidates = [r for r in usable if (backfill.room(r) if backfill else r.has_room())]
        if not candidates:
            return None
        chosen = prefix.choose(candidates, usable) if prefix else None
        if chosen is None:
            chosen = min(candidates, key=lambda r: r.outstanding)
        if prefix:
            prefix.sent(chosen)
        chosen.breaker.on_send(now)
        return chosen

    @staticmethod
    def draw_version(weights: dict[str, int], affinity: str | None = None) -> str | None:
        """A version by weight: the affinity key's stable bucket, else a random one."""
        bucket = affinity_bucket(affinity) if affinity else random.randrange(100)
        total = 0
        for version, weight in weights.items():
            total += weight
            if bucket < total:
                return version
        return None

    @staticmethod
    def bench(replica: ReplicaRoute) -> None:
        """The gateway could not reach `replica`: no more requests until the control plane's
        next health check readmits it (the generation does not move: that is control's)."""
        replica.ready = False
