"""Deploy validation: what a deploy request may ask for and what its artifact is, checked before
anything is written, so a bad request is refused at once instead of failing a replica later."""

from __future__ import annotations

from pathlib import Path

from modelyard.config import PlatformSettings
from modelyard.control.model_kind import UnknownArchitecture, detect
from modelyard.control.registry import Registry, ResolvedVersion
from modelyard.control.state import engine_env
from modelyard.core.errors import Forbidden, Invalid
from modelyard.core.identity import Principal
from modelyard.core.status import EndpointStatus
from modelyard.protocol.management import DeployRequest
from modelyard.store import repository as repo
from modelyard.store.tables import Endpoint

SUPPORTED_FRAMEWORKS = ("native",)
_REMOTE_SCHEMES = ("s3://", "gs://", "http://", "https://")


def check_request(principal: Principal, req: DeployRequest) -> None:
    """What needs no file or database: the caller's rights, the framework, engine options."""
    principal.require("admin")
    if req.framework not in SUPPORTED_FRAMEWORKS:
        raise Invalid(
            f"framework {req.framework!r} is not supported; use 'native' (modelyard's own "
            "engine: continuous batching, paged KV cache, OpenAI-compatible)",
            param="framework",
            code="unsupported_framework",
        )
    if req.public and not principal.platform_admin:
        raise Forbidden("only the platform admin can deploy public endpoints", param="public")
    engine_env(req.engine)  # a bad option is a 400 now, not a failed replica later


def resolve_artifact(
    settings: PlatformSettings, registry: Registry, principal: Principal, artifact: str
) -> tuple[Path | None, ResolvedVersion | None]:
    """A server path the caller may deploy from (checked: it exists, and a model nothing here
    serves is refused), or a registry version."""
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
