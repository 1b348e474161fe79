"""The routing table: which endpoints a tenant can address by model name, and their replicas.

The control plane writes it (each change bumps `generation`); the gateway reads it on every
request and picks the ready replica with the fewest requests in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class ReplicaRoute:
    replica_id: str
    url: str
    ready: bool = True
    outstanding: int = 0  # requests this gateway has in flight on it


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

    @property
    def outstanding(self) -> int:
        return sum(r.outstanding for r in self.replicas)


class RoutingTable:
    def __init__(self) -> None:
        self.generation = 0
        self._endpoints: dict[str, EndpointRoute] = {}

    def put(self, route: EndpointRoute) -> None:
        self._endpoints[route.endpoint_id] = route
        self.generation += 1

    def remove(self, endpoint_id: str) -> EndpointRoute | None:
        self.generation += 1
        return self._endpoints.pop(endpoint_id, None)

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
        candidates = [
            r for r in route.replicas if r.ready and (not exclude or r.replica_id not in exclude)
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda r: r.outstanding)
