"""Registry LoRA adapters on this node, for the endpoints that serve their base model.

An LLM endpoint deployed from registry model X with LoRA slots (`max_loras`) serves every adapter
pushed against X by X's owner and, when the endpoint is public, by any tenant
(`control/adapter_bases.py` finds the base at push). Its workers read them from one folder,
`<node cache>/adapters/<endpoint id>/<internal name>`, each entry a link to the adapter
version's verified node-cache copy (the engine's `lora_registry_dir`), named
`<tenant id>.<version id>` so that two tenants' adapters never collide; every version is there,
so a request may pin one (`support-bot:1`). The endpoint's route maps each tenant's adapter
names and versions to these names (`core/adapter_routes.py`); workers load an adapter into an
LRU slot on its first request. The folder is brought up to date before each replica starts and
whenever an adapter is pushed.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from modelyard.control.model_kind import LLM
from modelyard.control.node_cache import NodeCache
from modelyard.control.registry import Registry
from modelyard.control.state import EndpointState
from modelyard.core.adapter_routes import AdapterMap, internal_name
from modelyard.core.routing import RoutingTable
from modelyard.store.artifacts import ArtifactError

log = logging.getLogger(__name__)

ENV = "MODELYARD_LORA_REGISTRY_DIR"


def serves_adapters(state: EndpointState) -> bool:
    """An LLM endpoint from the registry with LoRA slots."""
    return state.kind in (None, LLM) and state.engine.max_loras > 0 and bool(state.row.version_id)


def adapter_folder(node_cache: NodeCache, endpoint_id: str) -> Path:
    return node_cache.root / "adapters" / endpoint_id


def sync(registry: Registry, node_cache: NodeCache, state: EndpointState) -> AdapterMap:
    """Bring the endpoint's adapter folder up to date (blocking: it may copy blobs); the
    adapters it now serves, by tenant and name."""
    assert state.row.version_id is not None
    base = registry.by_id(state.row.version_id)
    model_id = registry.model_id_of(state.row.version_id)
    row = state.row
    versions = registry.adapters_for(model_id, base.model_name, row.tenant_id, row.public)
    folder = adapter_folder(node_cache, state.row.id)
    folder.mkdir(parents=True, exist_ok=True)
    served: AdapterMap = {}
    for tenant_id, version in versions:
        name = internal_name(tenant_id, version.version_id)
        try:
            target = str(node_cache.fetch(version).path)
        except (OSError, ArtifactError) as exc:  # one tenant's broken adapter stops no replica
            log.warning("adapter %s left out of endpoint %s: %s", name, row.id, exc)
            continue
        served.setdefault((tenant_id, version.model_name), {})[version.version] = name
        link = folder / name
        if link.is_symlink() and os.readlink(link) == target:
            continue
        tmp = folder / f".{name}.new"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        tmp.symlink_to(target, target_is_directory=True)
        os.replace(tmp, link)  # a worker reading it sees the old or the new one, never none
    names = {n for versions_of in served.values() for n in versions_of.values()}
    for entry in folder.iterdir():
        if entry.name not in names and entry.is_symlink():
            entry.unlink()
    return served


def listing(
    routing: RoutingTable, endpoints: Mapping[str, EndpointState], tenant_id: str
) -> list[dict[str, Any]]:
    """The tenant's adapters: each one's base (the endpoint serving it), its versions, and on
    how many of that endpoint's replicas one of its versions sits in a LoRA slot now (their
    last health reports)."""
    out = []
    for name, routes in routing.adapter_index.names(tenant_id):
        route = routing.adapter_index.lookup(tenant_id, name) or routes[0]
        versions = route.adapters.get((tenant_id, name), {})
        internal = set(versions.values())
        state = endpoints.get(route.endpoint_id)
        replicas = state.replicas if state is not None else []
        loaded = sum(1 for r in replicas if internal & set((r.load or {}).get("lora_loaded") or ()))
        out.append({
            "object": "registry.adapter",
            "name": name,
            "base_model": route.model_name,
            "endpoint_id": route.endpoint_id,
            "versions": sorted(versions),
            "loaded_replicas": loaded,
            "state": f"loaded on {loaded} of {len(replicas)} replicas" if loaded else "cold",
        })  # fmt: skip
    return out
