"""Registry LoRA adapters on this node, for the endpoints that serve their base model.

An LLM endpoint deployed from registry model X with LoRA slots (`max_loras`) serves every adapter
of the same tenant pushed against X (`modelyard models push ADAPTER --name N --base X`). Its
workers read them from one folder, `<node cache>/adapters/<endpoint id>/<name>`, each entry a
link to the adapter version's verified node-cache copy (the engine's `lora_registry_dir`); the
endpoint's route lists the names, so a request may name an adapter by its own registry name.
The folder is brought up to date before each replica starts and whenever an adapter is pushed;
the newest version of each adapter is the one served (a worker holding an older one in a slot
keeps it until the slot is reused).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from modelyard.control.model_kind import LLM
from modelyard.control.node_cache import NodeCache
from modelyard.control.registry import Registry
from modelyard.control.state import EndpointState

ENV = "MODELYARD_LORA_REGISTRY_DIR"


def serves_adapters(state: EndpointState) -> bool:
    """An LLM endpoint from the registry with LoRA slots."""
    return state.kind in (None, LLM) and state.engine.max_loras > 0 and bool(state.row.version_id)


def adapter_folder(node_cache: NodeCache, endpoint_id: str) -> Path:
    return node_cache.root / "adapters" / endpoint_id


def sync(registry: Registry, node_cache: NodeCache, state: EndpointState) -> frozenset[str]:
    """Bring the endpoint's adapter folder up to date (blocking: it may copy blobs); the names
    it now serves."""
    assert state.row.version_id is not None
    base = registry.by_id(state.row.version_id).model_name
    adapters = registry.adapters_of(state.row.tenant_id, base)
    folder = adapter_folder(node_cache, state.row.id)
    folder.mkdir(parents=True, exist_ok=True)
    for name, version in adapters.items():
        target = str(node_cache.fetch(version).path)
        link = folder / name
        if link.is_symlink() and os.readlink(link) == target:
            continue
        tmp = folder / f".{name}.new"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        tmp.symlink_to(target, target_is_directory=True)
        os.replace(tmp, link)  # a worker reading it sees the old or the new one, never none
    for entry in folder.iterdir():
        if entry.name not in adapters and entry.is_symlink():
            entry.unlink()
    return frozenset(adapters)
