"""Which endpoint serves a tenant's registry LoRA adapter, and its name on the replicas.

A tenant's adapter pushed against a base model (its own, or a public one such as `smollm2`) is
served by the endpoints of that base: every endpoint of the tenant's own base, and every public
endpoint of a public base, whichever tenant pushed it. Each endpoint's route carries the
adapters it serves, `(tenant, name) → {version number: internal name}`; the internal name is
the adapter's folder on the replicas' node, `<tenant id>.<version id>` (`internal_name`), so two
tenants' adapters of the same name never meet on a shared base. A tenant names its adapter by
its registry name (`support-bot`, the newest version) or pinned (`support-bot:1`); no other
tenant finds it (`AdapterIndex.lookup` is keyed by tenant), and an internal name is never
accepted from a client (`is_internal`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

_INTERNAL = re.compile(r"\.mv-[0-9a-f]+$")

T = TypeVar("T")

# (tenant id, adapter name) → {version number: internal name}
AdapterMap = dict[tuple[str, str], dict[int, str]]


class AdapterServer(Protocol):
    """What the index needs of an endpoint's route."""

    endpoint_id: str
    tenant_id: str
    model_name: str
    adapters: AdapterMap


def internal_name(tenant_id: str, version_id: str) -> str:
    """The adapter version's name on the replicas (and its folder in the node cache)."""
    return f"{tenant_id}.{version_id}"


def is_internal(name: str) -> bool:
    """An internal adapter name (a client naming one directly is refused)."""
    return bool(_INTERNAL.search(name))


@dataclass(frozen=True)
class AdapterTarget:
    """A request's adapter: its registry reference (for usage rows) and its internal name."""

    name: str
    version: int
    internal: str

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"


def split_ref(model: str) -> tuple[str, int | None]:
    """`name` → (name, None); `name:3` → (name, 3); anything else → (model, None)."""
    name, sep, version = model.rpartition(":")
    if sep and version.isdigit() and name:
        return name, int(version)
    return model, None


def target_of(route: AdapterServer, tenant_id: str, name: str, version: int | None) -> (
    AdapterTarget | None
):  # fmt: skip
    """The tenant's adapter `name` (newest, or `version`) on `route`; None if it has none."""
    versions = route.adapters.get((tenant_id, name))
    if not versions:
        return None
    number = max(versions) if version is None else version
    internal = versions.get(number)
    return None if internal is None else AdapterTarget(name, number, internal)


def target_for(route: AdapterServer, tenant_id: str, model: str) -> AdapterTarget | None:
    """The tenant's adapter a request naming `model` gets on `route`: `name`, `name:N`, or
    `<route's model>:<name>`; None for the base model (or an adapter of the engine's own
    `lora_dir`)."""
    if model in (route.model_name, route.endpoint_id):
        return None
    name, version = split_ref(model)
    target = target_of(route, tenant_id, name, version)
    if target is None and ":" in model:
        prefix, _, name = model.rpartition(":")
        if prefix in (route.model_name, route.endpoint_id):
            target = target_of(route, tenant_id, name, None)
    return target


R = TypeVar("R", bound=AdapterServer)


class AdapterIndex(Generic[R]):
    """The routes serving each tenant's adapters, by (tenant, adapter name)."""

    def __init__(self) -> None:
        self._by_name: dict[tuple[str, str], list[R]] = {}
        self._of_tenant: dict[str, set[str]] = {}  # tenant → its adapters' names

    def set(self, route: R, adapters: AdapterMap) -> bool:
        """The adapters `route` serves now; False if nothing changed."""
        if adapters == route.adapters:
            return False
        self.drop(route)
        route.adapters = adapters
        self.add(route)
        return True

    def add(self, route: R) -> None:
        """Index the adapters `route` carries (a route joining the table)."""
        for key in route.adapters:
            self._by_name.setdefault(key, []).append(route)
            self._of_tenant.setdefault(key[0], set()).add(key[1])

    def drop(self, route: R) -> None:
        """`route` serves no adapter any more (it was removed, or is re-indexed)."""
        for key in route.adapters:
            if drop_from(self._by_name, key, route):
                names = self._of_tenant.get(key[0], set())
                names.discard(key[1])
                if not names:
                    self._of_tenant.pop(key[0], None)

    def lookup(self, tenant_id: str, model: str) -> R | None:
        """The route serving the tenant's adapter `model` (`name` or `name:N`): its own
        endpoint of the base before a public one; None if the tenant has no such adapter."""
        name, version = split_ref(model)
        routes = [
            r
            for r in self._by_name.get((tenant_id, name), ())
            if target_of(r, tenant_id, name, version) is not None
        ]
        own = [r for r in routes if r.tenant_id == tenant_id]
        return (own or routes)[0] if routes else None

    def names(self, tenant_id: str) -> list[tuple[str, list[R]]]:
        """The tenant's adapters and the routes serving each (`/v1/models`, listings)."""
        names = sorted(self._of_tenant.get(tenant_id, ()))
        return [(name, list(self._by_name[(tenant_id, name)])) for name in names]


def drop_from(index: dict[Any, list[T]], key: Any, item: T) -> bool:
    """Take `item` out of `index[key]`, and the key out when nothing is left under it (True
    then)."""
    same = index.get(key)
    if same is None:
        return False
    same[:] = [r for r in same if r is not item]
    if same:
        return False
    del index[key]
    return True
