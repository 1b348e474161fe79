"""Deploy validation: what a deploy request may ask for and what its artifact is, checked before
anything is written, so a bad request is refused at once instead of failing a replica later."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modelyard.config import PlatformSettings
from modelyard.control import runtimes
from modelyard.control.model_kind import UnknownArchitecture, detect
from modelyard.control.registry import Registry, ResolvedVersion
from modelyard.control.state import engine_env
from modelyard.core.errors import Forbidden, Invalid
from modelyard.core.identity import Principal
from modelyard.core.roles import DEPLOYERS
from modelyard.core.status import EndpointStatus
from modelyard.protocol.management import DeployRequest
from modelyard.store import repository as repo
from modelyard.store.tables import Endpoint

_REMOTE_SCHEMES = ("s3://", "gs://", "http://", "https://")


def check_request(principal: Principal, req: DeployRequest, settings: PlatformSettings) -> None:
    """What needs no file or database: the caller's rights, the framework (known, and its
    runtime installed on this node), engine options."""
    principal.require_any(DEPLOYERS)
    runtimes.check_framework(settings, req.framework)
    if req.public and not principal.platform_admin:
        raise Forbidden("only the platform admin can deploy public endpoints", param="public")
    engine_env(req.engine)  # a bad option is a 400 now, not a failed replica later


# Engine options that name a folder on the node. `lora_dir` is read by the worker (adapters), so it
# must lie under an allowed root like a model path; `cache_dir` is written (converted weights), so
# only the platform admin may move it.
_READ_PATHS = ("lora_dir",)
_WRITE_PATHS = ("cache_dir",)
_PLATFORM_ONLY = ("lora_registry_dir",)  # the platform fills it in (control/adapters.py)


def check_engine_paths(
    settings: PlatformSettings, principal: Principal, engine: dict[str, Any]
) -> None:
    """Path-like engine options: a tenant admin may only name absolute folders under
    `local_artifact_roots` (400 naming `engine.<option>`), never a folder the worker writes."""
    for key in _PLATFORM_ONLY:
        if engine.get(key) is not None:
            raise Invalid(
                f"engine.{key} is set by the platform, not in a deploy body",
                param=f"engine.{key}",
                code="path_not_allowed",
            )
    if principal.platform_admin:
        return
    for key in _WRITE_PATHS:
        if engine.get(key) is not None:
            raise Invalid(
                f"engine.{key} names where the worker writes on the node; only the platform "
                "admin may set it",
                param=f"engine.{key}",
                code="path_not_allowed",
            )
    roots = [r.resolve() for r in settings.local_artifact_roots]
    for key in _READ_PATHS:
        raw = engine.get(key)
        if raw is None:
            continue
        # Relative paths would be read relative to the worker's directory, not the one checked.
        path = Path(str(raw))
        if not path.is_absolute() or not any(path.resolve().is_relative_to(r) for r in roots):
            raise Invalid(
                f"engine.{key} must be an absolute folder under MODELYARD_LOCAL_ARTIFACT_ROOTS "
                f"({', '.join(map(str, roots)) or 'none configured'}); push adapters to the "
                "registry instead",
                param=f"engine.{key}",
                code="path_not_allowed",
            )


def resolve_artifact(
    settings: PlatformSettings, registry: Registry, principal: Principal, artifact: str
) -> tuple[Path | None, ResolvedVersion | None]:
    """A server path the caller may deploy from (checked: it exists, and a model nothing here
    serves is refused), or a registry version."""
    if artifact.startswith("s3://"):  # imported into the registry (control/s3_import.py)
        from modelyard.control.s3_import import import_s3_artifact

        return None, import_s3_artifact(settings, registry, principal, artifact)
    if artifact.startswith(_REMOTE_SCHEMES):
        raise Invalid(
            f"remote artifacts ({artifact.split(':', 1)[0]}://) need an object store, and "
            "none is configured; upload the model with `modelyard models push` and deploy "
            "it by its registry name",
            param="model_artifact",
            code="unsupported_artifact",
        )
    looks_like_path = artifact.startswith(("/", "./", "../", "~"))
    if not looks_like_path:
        return None, registry.resolve(principal.tenant_id, artifact)
    path = Path(artifact).expanduser().resolve()
    roots = [r.resolve() for r in settings.local_artifact_roots]
    if not principal.platform_admin and not any(path.is_relative_to(r) for r in roots):
        raise Forbidden(
            "deploying from a server path needs the platform admin (or a path under "
            "MODELYARD_LOCAL_ARTIFACT_ROOTS); push the model to the registry instead",
            param="model_artifact",
            code="path_not_allowed",
        )
    if not path.exists():
        raise Invalid(
            f"{path} does not exist on the server",
            param="model_artifact",
            code="artifact_not_found",
        )
    _refuse_unknown_architecture(path)
    return path, None


def _refuse_unknown_architecture(path: Path) -> None:
    """A local folder whose config names a model nothing here serves is refused at deploy (a
    registry version's files are fetched later: that one fails while provisioning instead).
    Other problems with the files are left to provisioning, which reports them as the status."""
    try:
        detect(path)
    except UnknownArchitecture:
        raise
    except Exception:
        return


def new_row(principal: Principal, req: DeployRequest, version: ResolvedVersion | None) -> Endpoint:
    """The endpoint's row as the request asks for it, provisioning."""
    return Endpoint(
        id=repo.new_id("ep"),
        tenant_id=principal.tenant_id,
        model_name=req.model_name,
        public=req.public,
        artifact=req.model_artifact
        if version is None
        else f"{version.model_name}:{version.version}",
        version_id=version.version_id if version else None,
        framework=req.framework,
        hardware=req.hardware.model_dump(),
        scaling=req.scaling.model_dump(),
        engine_options=req.engine,
        sampling_defaults=req.sampling_defaults.model_dump(exclude_none=True),
        status=EndpointStatus.PROVISIONING.value,
        status_message=None,
        created_at=repo.now(),
        deleted_at=None,
    )


def estimated_ready_seconds(path: Path | None, version: ResolvedVersion | None) -> int:
    """A rough time to ready from the model's size (~100 MB a second, plus a start)."""
    size = version.total_size if version else _size_of(path)
    return int(5 + size / 100e6)


def _size_of(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
