"""Backends start and stop replica processes; the endpoint manager decides how many and where."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelyard.config import PlatformSettings
    from modelyard.control.backends.base import Backend
    from modelyard.control.registry import Registry


def open_backend(
    settings: PlatformSettings,
    log_dir: Path,
    registry: Registry | None = None,
    detached: bool = False,
) -> Backend:
    """The backend `settings.backend` names; Ray is imported only when it is chosen.

    `registry`: where the ray backend looks up a version's files for its nodes (else it opens
    the registry the settings name); `detached`: replicas outlive this process (the
    `controller` role, whose successor adopts them)."""
    if settings.backend == "ray":
        from modelyard.control.backends.ray import RayBackend

        return RayBackend(settings, log_dir, registry, detached=detached)
    from modelyard.control.backends.local import LocalBackend
    from modelyard.core.cluster_auth import replica_token
    from modelyard.core.owner_watch import owner_timeout_s

    return LocalBackend(
        log_dir,
        detached=detached,
        token=replica_token(settings),
        owner_timeout_s=owner_timeout_s(settings),
    )
