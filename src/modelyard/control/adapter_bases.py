"""The base model a pushed LoRA adapter names, found among what the tenant can see, and the
adapter checked against it before the version exists.

The base is `base_model` or, when the push leaves it out, the `base_model_name_or_path` of the
adapter's `adapter_config.json` (that name, else its last path component: `org/SmolLM2` names
`SmolLM2`). It is a model of the tenant's own registry, else the model a live public endpoint of
that name serves (the platform's `smollm2`). The adapter's manifest records the base's registry
model id (`base_model_id`), which is how endpoints serving that model find the adapters they
serve, whichever tenant pushed them (`control/adapters.py`). The adapter's rank and shapes are
checked here (`core/adapter_shapes.py`) against the base's dimensions and the `max_lora_rank`
of the base's live endpoints, so a request never meets an adapter its base cannot load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from modelyard.config.engine_settings import EngineSettings
from modelyard.core.adapter_shapes import (
    WEIGHTS,
    check_adapter,
    dims_from_config,
    dims_from_gguf,
    safetensors_shapes,
)
from modelyard.core.errors import Invalid
from modelyard.core.gguf_header import gguf_ints
from modelyard.core.model_file_limits import MAX_CONFIG_BYTES, bounded_json, read_exact
from modelyard.store import repository as repo
from modelyard.store.artifact_store import BlobStore
from modelyard.store.db import Database
from modelyard.store.tables import Endpoint, Model, ModelVersion

_DEFAULT_RANK = int(EngineSettings.model_fields["max_lora_rank"].default)


@dataclass(frozen=True)
class Base:
    model_id: str
    name: str  # as the tenant named it
    version: ModelVersion
    max_rank: int


def _json(store: BlobStore, meta: dict[str, Any], path: str) -> Any:
    size = int(meta["size"])
    if size > MAX_CONFIG_BYTES:
        raise Invalid(f"{path} is over {MAX_CONFIG_BYTES} bytes", param="files")
    reader = store.open(meta["sha256"])
    try:
        return bounded_json(read_exact(reader, size, path), path)
    finally:
        reader.close()


def _rank_cap(endpoints: list[Endpoint]) -> int:
    caps = [int((e.engine_options or {}).get("max_lora_rank", _DEFAULT_RANK)) for e in endpoints]
    return max(caps, default=_DEFAULT_RANK)


def _find(db: Database, tenant_id: str, model_name: str, candidate: str) -> Base | None:
    with db.session() as s:
        own = repo.get_model(s, tenant_id, candidate)
        if own is not None and own.name != model_name:
            version = repo.get_version(s, own.id, None)
            if version is not None and version.format != "lora":
                serving = [
                    e for e in repo.endpoints_using_model(s, tenant_id, own.id) if e.version_id
                ]
                return Base(own.id, own.name, version, _rank_cap(serving))
        public = s.scalars(
            select(Endpoint).where(
                Endpoint.public.is_(True),
                Endpoint.deleted_at.is_(None),
                Endpoint.model_name == candidate,
                Endpoint.version_id.is_not(None),
            )
        ).all()
        for endpoint in public:
            version = s.get(ModelVersion, endpoint.version_id)
            model = s.get(Model, version.model_id) if version is not None else None
            if version is not None and model is not None and version.format != "lora":
                return Base(model.id, candidate, version, _rank_cap(list(public)))
    return None


def find_base(
    db: Database, store: BlobStore, tenant_id: str, model_name: str,
    manifest: dict[str, Any], base_model: str | None,
) -> tuple[Base, dict[str, Any]]:  # fmt: skip
    """The base the adapter names (`Invalid` naming `base_model` if none the tenant can see),
    and the adapter's `adapter_config.json`."""
    config = _json(store, manifest["adapter_config.json"], "adapter_config.json")
    if not isinstance(config, dict):
        raise Invalid("adapter_config.json must be a JSON object", param="files")
    named = base_model
    if named is None:
        hint = config.get("base_model_name_or_path")
        if not isinstance(hint, str) or not hint or len(hint) > 1000:
            raise Invalid(
                "a lora adapter needs base_model (a registry model name or a public model), "
                "or base_model_name_or_path in its adapter_config.json",
                param="base_model",
            )
        named = hint
    candidates = [named] if base_model is not None else [named, named.rstrip("/").rsplit("/")[-1]]
    for candidate in candidates:
        base = _find(db, tenant_id, model_name, candidate)
        if base is not None:
            return base, config
    raise Invalid(
        f"base_model {named[:200]!r} is not a model in this tenant's registry nor a public model",
        param="base_model",
        code="model_not_found",
    )


def check_against_base(
    store: BlobStore, base: Base, manifest: dict[str, Any], config: dict[str, Any]
) -> int:
    """The adapter's rank once its shapes fit the base (`Invalid` naming the field)."""
    files = base.version.manifest["files"]
    dims: dict[str, int] = {}
    if "config.json" in files:
        raw = _json(store, files["config.json"], "config.json")
        dims = dims_from_config(raw if isinstance(raw, dict) else {})
    else:
        gguf = next((p for p in files if p.endswith(".gguf")), None)
        if gguf is not None:
            reader = store.open(files[gguf]["sha256"])
            try:
                dims = dims_from_gguf(gguf_ints(reader, gguf))
            finally:
                reader.close()
    meta = manifest[WEIGHTS]
    reader = store.open(meta["sha256"])
    try:
        shapes = safetensors_shapes(reader, int(meta["size"]))
    finally:
        reader.close()
    return check_adapter(config, shapes, dims, base.max_rank)
