"""The model registry: models, their immutable versions, and the blobs the versions are made of.

A version is created from a manifest of files that are already in the artifact store (uploaded
one by one, each verified against its sha256), in one transaction: either the whole version
exists or nothing does. Versions are referenced as `name` (newest) or `name:N`. A `lora` version
is a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`) recorded against a base
model of the same tenant's registry or a public one (`adapter_bases.py`); endpoints serving that
base serve its adapters (`adapters.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select

from modelyard.control.adapter_bases import check_against_base, find_base
from modelyard.core.errors import Conflict, Invalid, NotFound
from modelyard.core.model_files import ModelFacts, inspect_files
from modelyard.store import budgets as budget_rows
from modelyard.store import repository as repo
from modelyard.store import storage
from modelyard.store.artifact_store import BlobStore
from modelyard.store.artifacts import ArtifactError, check_relative_path, scan_folder
from modelyard.store.db import Database
from modelyard.store.tables import Model, ModelVersion

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
FORMATS = ("hf", "gguf", "lora")


def check_model_name(name: str) -> str:
    if not _NAME.match(name):
        raise Invalid(
            f"invalid model name {name!r}: use letters, digits, '.', '_' and '-' "
            "(at most 128, starting with a letter or digit)",
            param="name",
            code="invalid_value",
        )
    return name


def detect_format(paths: list[str]) -> str:
    if "adapter_config.json" in paths and "config.json" not in paths:
        return "lora"
    if "config.json" in paths:
        return "hf"
    ggufs = [p for p in paths if p.endswith(".gguf")]
    if len(ggufs) == 1:
        return "gguf"
    raise Invalid(
        "cannot tell the model format: expected a Hugging Face folder (config.json + weights) "
        "or exactly one .gguf file",
        param="files",
        code="invalid_manifest",
    )


def parse_ref(ref: str) -> tuple[str, int | None]:
    """`name` → (name, None = newest); `name:3` → (name, 3)."""
    name, sep, version = ref.partition(":")
    if sep and not version.isdigit():
        raise Invalid(f"invalid model reference {ref!r} (use NAME or NAME:VERSION)")
    return check_model_name(name), int(version) if sep else None


@dataclass(frozen=True)
class ResolvedVersion:
    version_id: str
    model_name: str
    version: int
    format: str
    files: dict[str, str]  # relative path → sha256
    total_size: int
    base_model: str | None = None  # a `lora` version's base (a registry model name)
    param_count: int | None = None  # recorded at push (None: pushed before it was recorded)


def _resolved(model_name: str, v: ModelVersion) -> ResolvedVersion:
    files = {path: meta["sha256"] for path, meta in v.manifest["files"].items()}
    base = v.manifest.get("base_model")
    return ResolvedVersion(
        v.id, model_name, v.version, v.format, files, v.total_size, base, v.param_count
    )


class Registry:
    def __init__(self, db: Database, store: BlobStore, storage_bytes: int | None = None) -> None:
        self.db = db
        self.store = store
        # A tenant's storage quota unless it has its own (`store/storage.py`); None: none.
        self.storage_bytes = storage_bytes

    def add_blob(self, tenant_id: str, sha256: str, size: int) -> None:
        """Record that the tenant holds the blob it uploaded, within its storage quota."""
        with self.db.session() as s:
            storage.hold(s, tenant_id, sha256, size, self.storage_bytes)

    def room(self, tenant_id: str) -> int | None:
        """The bytes the tenant may still upload (None: no quota)."""
        with self.db.session() as s:
            return storage.room(s, tenant_id, self.storage_bytes)

    def has_blob(self, tenant_id: str, sha256: str) -> bool:
        """True if this tenant uploaded the blob (and it is still on disk)."""
        with self.db.session() as s:
            owned = repo.owns_blob(s, tenant_id, sha256)
        return owned and self.store.has(sha256)

    def create_version(
        self,
        tenant_id: str,
        model_name: str,
        files: dict[str, dict[str, Any]],
        fmt: str | None,
        base_model: str | None = None,
    ) -> ResolvedVersion:
        check_model_name(model_name)
        if not files:
            raise Invalid("a version needs at least one file", param="files")
        manifest: dict[str, dict[str, Any]] = {}
        total = 0
        for path, meta in files.items():
            try:
                check_relative_path(path)
            except ArtifactError as exc:
                raise Invalid(str(exc), param="files", code="invalid_manifest") from exc
            sha = str(meta.get("sha256", ""))
            if not _SHA256.match(sha) or not self.has_blob(tenant_id, sha):
                raise Invalid(
                    f"file {path!r}: blob {sha!r} has not been uploaded (PUT /v1/blobs/{{sha256}})",
                    param="files",
                    code="missing_blob",
                )
            size = self.store.size(sha)
            if "size" in meta and int(meta["size"]) != size:
                raise Invalid(
                    f"file {path!r}: size {meta['size']} does not match the blob's {size}",
                    param="files",
                    code="invalid_manifest",
                )
            manifest[path] = {"sha256": sha, "size": size}
            total += size
        fmt = fmt or detect_format(list(manifest))
        if fmt not in FORMATS:
            raise Invalid(f"format must be one of {', '.join(FORMATS)}", param="format")
        # Every file anything parses later, checked with hard limits before the version exists
        # (callers run this in a thread); its size figure is recorded with it.
        facts = self._inspect(manifest)
        extra = self._check_base(tenant_id, model_name, fmt, manifest, base_model)
        with self.db.session() as s:
            model = repo.get_model(s, tenant_id, model_name) or repo.create_model(
                s, tenant_id, model_name
            )
            version = repo.add_version(
                s, model.id, fmt, {"files": manifest, **extra}, total, facts.param_count
            )
            return _resolved(model_name, version)

    def _inspect(self, manifest: dict[str, dict[str, Any]]) -> ModelFacts:
        sizes = {path: int(meta["size"]) for path, meta in manifest.items()}
        return inspect_files(sizes, lambda path: self.store.open(manifest[path]["sha256"]))

    def param_count(self, version_id: str) -> int:
        """The version's recorded size figure. A version pushed before it was recorded has it
        computed now, once, with the bounded parser (this runs in a thread, never on a loop),
        and stored; a file that breaks a limit raises `ModelFileError`."""
        with self.db.session() as s:
            version = repo.version_by_id(s, version_id)
            assert version is not None, version_id
            if version.param_count is not None:
                return version.param_count
            manifest = version.manifest["files"]
        count = self._inspect(manifest).param_count
        with self.db.session() as s:
            version = repo.version_by_id(s, version_id)
            if version is not None:
                version.param_count = count
        return count

    def _check_base(
        self,
        tenant_id: str,
        model_name: str,
        fmt: str,
        manifest: dict[str, Any],
        base_model: str | None,
    ) -> dict[str, Any]:
        """A `lora` version names its base (a model of this tenant's registry or a public one,
        not an adapter: `control/adapter_bases.py`), holds the PEFT pair, and fits the base's
        shapes; nothing else names a base."""
        if fmt != "lora":
            if base_model is not None:
                raise Invalid("only a lora adapter names a base_model", param="base_model")
            return {}
        missing = {"adapter_config.json", "adapter_model.safetensors"} - set(manifest)
        if missing:
            raise Invalid(
                f"a lora adapter needs {', '.join(sorted(missing))}",
                param="files",
                code="invalid_manifest",
            )
        if base_model is not None:
            check_model_name(base_model)
        base, config = find_base(self.db, self.store, tenant_id, model_name, manifest, base_model)
        rank = check_against_base(self.store, base, manifest, config)
        return {"base_model": base.name, "base_model_id": base.model_id, "rank": rank}

    def adapters_for(
        self, base_model_id: str, base_name: str, owner_id: str, public: bool
    ) -> list[tuple[str, ResolvedVersion]]:
        """Every version of the adapters an endpoint of registry model `base_model_id` (owned
        by `owner_id`) serves, with their tenants: the owner's, and (`public`) every tenant's;
        adapters pushed before the base's id was recorded match the owner's by name."""
        out: list[tuple[str, ResolvedVersion]] = []
        with self.db.session() as s:
            rows = s.execute(
                select(Model, ModelVersion)
                .join(ModelVersion, ModelVersion.model_id == Model.id)
                .where(ModelVersion.format == "lora")
                .order_by(Model.created_at, ModelVersion.version)
            ).all()
            for m, v in rows:
                if v.manifest.get("base_model_id") == base_model_id:
                    if public or m.tenant_id == owner_id:
                        out.append((m.tenant_id, _resolved(m.name, v)))
                elif (
                    "base_model_id" not in v.manifest
                    and m.tenant_id == owner_id
                    and v.manifest.get("base_model") == base_name
                ):
                    out.append((m.tenant_id, _resolved(m.name, v)))
        return out

    def model_id_of(self, version_id: str) -> str:
        with self.db.session() as s:
            version = repo.version_by_id(s, version_id)
            assert version is not None, version_id
            return version.model_id

    def register_folder(self, tenant_id: str, model_name: str, source: Path) -> ResolvedVersion:
        """Copy a local folder (or single file) into the store and register it as a version,
        unless the newest version already has exactly these files."""
        files: dict[str, dict[str, Any]] = {}
        for rel, path in scan_folder(source):
            blob = self.store.put_file(path)
            self.add_blob(tenant_id, blob.sha256, blob.size)
            files[rel] = {"sha256": blob.sha256, "size": blob.size}
        newest = self.resolve(tenant_id, model_name, missing_ok=True)
        if newest is not None and newest.files == {k: v["sha256"] for k, v in files.items()}:
            return newest
        return self.create_version(tenant_id, model_name, files, None)

    def resolve(self, tenant_id: str, ref: str, missing_ok: bool = False) -> ResolvedVersion | None:
        name, number = parse_ref(ref)
        with self.db.session() as s:
            model = repo.get_model(s, tenant_id, name)
            version = repo.get_version(s, model.id, number) if model else None
        if version is None:
            if missing_ok:
                return None
            raise NotFound(
                f"model {ref!r} is not in the registry",
                param="model_artifact",
                code="model_not_found",
            )
        return _resolved(name, version)

    def by_id(self, version_id: str) -> ResolvedVersion:
        with self.db.session() as s:
            version = repo.version_by_id(s, version_id)
            assert version is not None, version_id
            model = s.get(Model, version.model_id)
            assert model is not None
            return _resolved(model.name, version)

    # ----- listing, for the API ---------------------------------------------------------------

    def list_models(self, tenant_id: str) -> list[dict[str, Any]]:
        with self.db.session() as s:
            out = []
            for m in repo.list_models(s, tenant_id):
                versions = repo.list_versions(s, m.id)
                out.append(
                    {
                        "name": m.name,
                        "id": m.id,
                        "created_at": int(repo.as_utc(m.created_at).timestamp()),
                        "versions": [version_dict(m.name, v) for v in versions],
                    }
                )
            return out

    def delete_model(self, tenant_id: str, name: str) -> None:
        with self.db.session() as s:
            model = repo.get_model(s, tenant_id, check_model_name(name))
            if model is None:
                raise NotFound(f"model {name!r} is not in the registry", code="not_found")
            using = repo.endpoints_using_model(s, tenant_id, model.id)
            if using:
                names = ", ".join(sorted(e.model_name for e in using)[:5])
                raise Conflict(
                    f"model {name!r} is in use by live endpoint(s) {names} (as their version, "
                    "a canary, or the version they fall back to); delete them first",
                    code="model_in_use",
                )
            repo.release_deleted_endpoints(s, model.id)
            versions = repo.list_versions(s, model.id)
            shas = storage.shas_of_versions(versions)
            for v in versions:
                s.delete(v)
            budget_rows.drop_adapter_price(s, model.id)
            s.delete(model)
            storage.release(s, tenant_id, shas)  # what nothing else of the tenant's uses


def version_dict(model_name: str, v: ModelVersion) -> dict[str, Any]:
    return {
        "id": v.id,
        "model": model_name,
        "version": v.version,
        "ref": f"{model_name}:{v.version}",
        "format": v.format,
        "base_model": v.manifest.get("base_model"),
        "total_size": v.total_size,
        "param_count": v.param_count,
        "files": v.manifest["files"],
        "created_at": int(repo.as_utc(v.created_at).timestamp()),
    }
