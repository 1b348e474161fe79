"""The services the platform's routes use, handed to the app by the composition root.

`platform.py` builds every object and passes this bundle to `create_platform_app`; the routes
reach it through the `get_services` dependency, so the api layer never imports the composition
root (which imports the api to build its app).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from modelyard.batch.files import FileService
from modelyard.batch.service import BatchService
from modelyard.config import PlatformSettings
from modelyard.control.audit import AuditLog
from modelyard.control.budgets import Budgets
from modelyard.control.endpoint_versions import VersionVerbs
from modelyard.control.endpoints import EndpointManager
from modelyard.control.oidc import OidcClient
from modelyard.control.people import People
from modelyard.control.registry import Registry
from modelyard.control.sso import ConsoleSignIn
from modelyard.control.tenancy import Tenancy
from modelyard.core.routing import RoutingTable
from modelyard.gateway.auth import Authenticator
from modelyard.gateway.metering import UsageRecorder
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.proxy import Gateway
from modelyard.store.artifacts import ArtifactStore
from modelyard.store.db import Database
from modelyard.store.storage import Reclaimer


@dataclass(frozen=True)
class Services:
    settings: PlatformSettings
    db: Database
    store: ArtifactStore
    registry: Registry
    routing: RoutingTable
    auth: Authenticator
    recorder: UsageRecorder
    metrics: GatewayMetrics
    endpoints: EndpointManager
    versions: VersionVerbs  # an endpoint's version changes: rollout, canary, promote, rollback
    gateway: Gateway
    files: FileService
    batches: BatchService
    audit: AuditLog
    tenancy: Tenancy
    people: People  # users, teams, membership
    # Sweeps blobs no tenant holds; told after a delete (None: nothing sweeps here).
    reclaimer: Reclaimer | None = None
    # Console single sign-on (None: not configured).
    oidc: OidcClient | None = None
    sign_in: ConsoleSignIn | None = None
    budgets: Budgets | None = None  # prices and budgets in dollars


class Lifecycle(Protocol):
    """What the app's lifespan starts before serving and stops after (the platform)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
