"""The composition root of `modelyard serve`: builds every part, starts and stops them in order.

Start: migrate the schema, replay usage journals left by a crash, seed quota counters from the
month's usage, bootstrap the platform admin key and the default models on first start, then the
usage writer, the gateway client and the endpoint manager (which re-provisions every live
endpoint). The default models deploy in the background, so HTTP (`/health`, their endpoints'
`provisioning` status) answers while they load. Stop: the reverse, with replicas terminated and
pending usage flushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from modelyard.api.services import Services
from modelyard.batch.budget_alerts import BudgetAlerts
from modelyard.batch.files import FileService
from modelyard.batch.runner import BatchRunner
from modelyard.batch.service import BatchService
from modelyard.batch.webhook_policy import WebhookPolicy
from modelyard.config import PlatformSettings
from modelyard.control.audit import AuditLog
from modelyard.control.backends import open_backend
from modelyard.control.backends.base import Backend
from modelyard.control.budgets import Budgets
from modelyard.control.endpoints import EndpointManager
from modelyard.control.oidc import OidcClient
from modelyard.control.people import People
from modelyard.control.registry import Registry
from modelyard.control.sso import ConsoleSignIn
from modelyard.control.takeover import ReplicaTakeover
from modelyard.control.tenancy import Tenancy
from modelyard.core.cluster_auth import ensure_replica_secret
from modelyard.core.identity import Principal
from modelyard.core.routing import RoutingTable
from modelyard.engine.models.bundled import BUNDLED_MODELS, ModelNotFoundError, resolve_model_path
from modelyard.gateway.auth import Authenticator, generate_key
from modelyard.gateway.metering import UsageRecorder
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.proxy import Gateway
from modelyard.gateway.ratelimit import (
    MemoryQuotaCounter,
    MemoryRateLimiter,
    QuotaCounter,
    RateLimiter,
    RedisQuotaCounter,
    RedisRateLimiter,
)
from modelyard.gateway.redis_connect import open_redis
from modelyard.gateway.usage_journal import UsageJournal
from modelyard.protocol.management import DeployRequest, SamplingDefaults
from modelyard.store import repository as repo
from modelyard.store.artifact_store import open_artifact_store
from modelyard.store.artifacts import ArtifactStore, make_owner_only
from modelyard.store.db import Database
from modelyard.store.storage import Reclaimer

log = logging.getLogger(__name__)

# SmolLM2's model card samples at temperature 0.2, top_p 0.9; at the API's default temperature
# of 1 the 135M model (here from a 4-bit GGUF) rambles in most answers.
_BUNDLED_SAMPLING = {"smollm2": SamplingDefaults(temperature=0.2, top_p=0.9)}
_SHARED_BASES = ("smollm2",)  # bundled LLMs: tenants' adapters are served on their replicas

ADMIN_KEY_FILE = "admin_key"
SYSTEM_TENANT = "system"


@dataclass(frozen=True)
class Bootstrap:
    admin_key: str | None  # only on the very first start
    admin_key_file: Path


class Platform:
    def __init__(
        self,
        settings: PlatformSettings,
        backend: Backend | None = None,
        takeover: ReplicaTakeover | None = None,
    ) -> None:
        """`backend` and `takeover`: what the cluster's controller role runs with instead of
        `serve`'s (`roles.py`: a backend whose replicas outlive it, and the takeover of those
        its predecessor left running); `serve` passes neither."""
        self.settings = settings
        ensure_replica_secret(settings)  # before any part that talks to replicas is built
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        # Keys, usage and tenants' files live here: owner-only, also on installs made before.
        settings.data_dir.chmod(0o700)
        self.db = Database(settings.resolved_database_url)
        # Built first: the endpoint manager records automatic rollbacks in it too.
        self.audit = AuditLog(self.db)
        self.store = ArtifactStore(settings.data_dir / "artifacts")  # the Files API's files
        # Model blobs: this store too, or an S3 bucket every node shares (artifact_store = s3).
        self.registry = Registry(
            self.db, open_artifact_store(settings, self.store), settings.tenant_storage_bytes
        )
        # Blobs no tenant holds any more (deleted files and models) leave both stores.
        self.reclaimer = Reclaimer(
            self.db,
            [self.store, self.registry.store],
            settings.blob_reclaim_grace_s,
            settings.blob_reclaim_interval_s,
        )
        self.routing = RoutingTable()
        self.limiter: RateLimiter
        self.quota: QuotaCounter
        self._redis = None
        if settings.redis_url:
            self._redis = open_redis(settings.redis_url, settings.redis_timeout_s)
            self.limiter = RedisRateLimiter(self._redis)
            self.quota = RedisQuotaCounter(self._redis)
        else:
            self.limiter = MemoryRateLimiter()
            self.quota = MemoryQuotaCounter()
        self.auth = Authenticator(
            self.db,
            settings.auth_cache_ttl_s,
            stale_ttl_s=settings.auth_stale_ttl_s,
            last_used_every_s=settings.key_last_used_interval_s,
        )
        self.metrics = GatewayMetrics()
        journal = UsageJournal(settings.data_dir / "usage-journal", settings.usage_journal_fsync)
        self.recorder = UsageRecorder(self.db, journal=journal)
        self.backend = backend or open_backend(settings, settings.data_dir / "logs", self.registry)
        self.endpoints = self._endpoint_manager(takeover)
        # The gateway reaches the control plane only through this verb (scale from zero).
        self.gateway = Gateway(
            settings,
            self.auth,
            self.limiter,
            self.quota,
            self.routing,
            self.recorder,
            self.metrics,
            activate=self.endpoints.activate,
        )
        # Budgets in dollars: their soft limits' alerts (webhook, audit), their management.
        book = self.gateway.accounting.budgets
        assert book is not None
        self.budget_alerts = BudgetAlerts(
            self.db, WebhookPolicy(settings.batch_webhook_hosts), self.audit.record
        )
        book.sink = self.budget_alerts
        # The canary's SLO gate reads each version's outcomes through this verb of the gateway's.
        self.endpoints.versions.read_stats = self.gateway.upstream.stats.window
        self.files = FileService(
            self.db,
            self.store,
            settings.max_file_bytes,
            settings.batch_max_line_bytes,
            settings.batch_max_file_bytes,
            settings.tenant_storage_bytes,
        )
        self.batches = BatchService(
            self.db, self.files, WebhookPolicy(settings.batch_webhook_hosts)
        )
        self.batch_runner = BatchRunner(
            settings,
            self.db,
            self.files,
            sender=self.gateway,
            routing=self.routing,
        )
        self.oidc = (
            OidcClient(
                settings.oidc_issuer,
                settings.oidc_client_id,
                settings.oidc_client_secret,
                settings.oidc_scopes,
                settings.oidc_timeout_s,
            )
            if settings.oidc_issuer and settings.oidc_client_id
            else None
        )
        self.services = Services(
            settings=settings,
            db=self.db,
            store=self.store,
            registry=self.registry,
            routing=self.routing,
            auth=self.auth,
            recorder=self.recorder,
            metrics=self.metrics,
            endpoints=self.endpoints,
            versions=self.endpoints.version_verbs,
            gateway=self.gateway,
            files=self.files,
            batches=self.batches,
            audit=self.audit,
            tenancy=Tenancy(self.db, self.audit, self.auth.invalidate, generate_key),
            people=People(self.db, self.audit, self.auth.invalidate),
            reclaimer=self.reclaimer,
            oidc=self.oidc,
            sign_in=ConsoleSignIn(self.db, self.audit, settings) if self.oidc else None,
            budgets=Budgets(self.db, self.audit, book.invalidate),
        )
        self.bootstrap: Bootstrap | None = None
        self.on_ready: Callable[[], None] | None = None  # e.g. the CLI's banner
        self._loading: asyncio.Task[None] | None = None

    def _endpoint_manager(self, takeover: ReplicaTakeover | None) -> EndpointManager:
        return EndpointManager(
            self.settings,
            self.db,
            self.registry,
            self.backend,
            self.routing,
            audit=self.audit,
            takeover=takeover,
        )

    def renew_endpoints(self, takeover: ReplicaTakeover | None) -> None:
        """A fresh endpoint manager in place of a stopped one (a cluster controller's next term
        as the leader starts from the database, with nothing of its last term's state); the
        caller hands the app the new `services`."""
        read_stats = self.endpoints.versions.read_stats
        self.endpoints = self._endpoint_manager(takeover)
        self.endpoints.versions.read_stats = read_stats
        self.services = dataclasses.replace(self.services, endpoints=self.endpoints)

    async def start(self) -> None:
        await asyncio.to_thread(self.db.migrate)
        await asyncio.to_thread(self._secure_files)
        await self.recorder.recover()  # before seeding: replayed usage counts against quotas
        await self._seed_quotas()
        self.bootstrap = await asyncio.to_thread(self._bootstrap_admin)
        self.recorder.start()
        await self.gateway.start()
        await self.endpoints.start()
        self.batch_runner.start()
        self.reclaimer.start()
        if self.settings.default_models:
            self._loading = asyncio.create_task(self._load_in_background())
        else:
            await self._start_warm_pool()
        if self.on_ready is not None:
            self.on_ready()

    async def loaded(self) -> None:
        """Wait until the default models are ready (or failed) and the warm pool started."""
        if self._loading is not None:
            await asyncio.shield(self._loading)

    async def _load_in_background(self) -> None:
        try:
            await self._deploy_default_models()
            # After the defaults, so a warm replica does not compete with their load.
            await self._start_warm_pool()
        except Exception:
            # The platform keeps serving; a failed endpoint shows its status.
            log.exception("loading the default models failed")

    async def _start_warm_pool(self) -> None:
        admin = await asyncio.to_thread(self.system_principal)
        await self.endpoints.warm_pool.start(admin.tenant_id)

    async def stop(self) -> None:
        if self._loading is not None:
            self._loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loading
        # Items in flight are not recorded: they are pending again on the next start.
        await self.batch_runner.stop()
        await self.reclaimer.stop()
        await self.endpoints.stop()
        await self.recorder.stop()
        await self.budget_alerts.stop()
        await self.gateway.stop()
        await self.limiter.close()
        if self.oidc is not None:
            await self.oidc.aclose()
        if self._redis is not None:
            await self._redis.aclose()
        self.db.dispose()

    def _secure_files(self) -> None:
        """Owner-only files, also for installs made before (0644 database, 0444 blobs)."""
        self.db.secure_file()
        key_file = self.settings.data_dir / ADMIN_KEY_FILE
        if key_file.exists():
            key_file.chmod(0o600)
        for folder in ("artifacts", "node-cache", "logs"):
            make_owner_only(self.settings.data_dir / folder)

    async def _seed_quotas(self) -> None:
        """The quota counters from the usage rows: seeded in memory, rebuilt in Redis if it lost
        them (`gateway/quota_rebuild.py`; every quota check rechecks that afterwards); so are
        the budgets' spend counters in Redis (`gateway/spend_rebuild.py`)."""
        await self.gateway.accounting.quota_rebuild.at_start()
        budgets = self.gateway.accounting.budgets
        if budgets is not None:
            await budgets.spend_rebuild.at_start()

    def _bootstrap_admin(self) -> Bootstrap:
        key_file = self.settings.data_dir / ADMIN_KEY_FILE
        with self.db.session() as s:
            if repo.system_tenant(s) is not None:
                return Bootstrap(None, key_file)
            tenant = repo.create_tenant(s, SYSTEM_TENANT, None, is_system=True)
            key, key_hash, prefix = generate_key()
            repo.add_key(
                s,
                tenant.id,
                "bootstrap admin",
                key_hash,
                prefix,
                ["admin", "inference"],
                None,
                None,
            )
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return Bootstrap(key, key_file)

    def system_principal(self) -> Principal:
        with self.db.session() as s:
            tenant = repo.system_tenant(s)
            assert tenant is not None
            return Principal.system(tenant)

    async def _deploy_default_models(self) -> None:
        """Register the bundled models (once) and deploy them as public endpoints."""
        admin = await asyncio.to_thread(self.system_principal)
        for name in BUNDLED_MODELS:
            package = BUNDLED_MODELS[name][0]
            if importlib.util.find_spec(package) is None:
                log.warning("bundled model %s skipped: package %s is not installed", name, package)
                continue
            if self.routing.resolve(admin.tenant_id, name) is not None:
                continue  # deployed on an earlier start and re-provisioned already
            try:
                source = resolve_model_path(name)
            except ModelNotFoundError as exc:
                log.warning("bundled model %s skipped: %s", name, exc)
                continue
            await asyncio.to_thread(self.registry.register_folder, admin.tenant_id, name, source)
            request = DeployRequest(
                model_name=name,
                model_artifact=name,
                public=True,
                sampling_defaults=_BUNDLED_SAMPLING.get(name, SamplingDefaults()),
                # The public LLM is a shared base: tenants' adapters load into its slots.
                engine={"max_loras": self.settings.bundled_max_loras}
                if name in _SHARED_BASES and self.settings.bundled_max_loras
                else {},
            )
            result = await self.endpoints.deploy(admin, request)
            status = await self.endpoints.wait_ready(
                result["endpoint_id"], self.settings.replica_start_timeout_s
            )
            log.info("default model %s: %s", name, status)
