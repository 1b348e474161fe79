"""The cluster's roles, each its own process (`modelyard gateway`, `modelyard controller`), built
from the same parts as `serve` (`platform.Platform`) with the state they share in PostgreSQL and
Redis instead of in memory.

- Gateway: auth, limits and quotas (Redis), metering (PostgreSQL), proxying; its routing table
  is a mirror of the one the leading controller publishes (`gateway/route_mirror.py`). It runs
  no replica and no control loop; control requests go on to the leader (`api/control_forward.py`).
- Controller: the whole control plane, but only while it holds the leader lease
  (`control/leader.py`). A standby tries for the lease every third of `controller_lease_s`; on
  taking it, it resumes from the database: bootstraps the admin key on a first start, adopts the
  replicas its predecessor left running (`control/takeover.py`), publishes the routing
  table, sums the gateways' load from Redis for its autoscaler, and runs the batch runner
  (whose item leases make a takeover lose and repeat nothing). A leader that loses its lease
  while running (cut off from the database) exits at once, code 3: nothing of its leadership
  lingers, and its supervisor restarts it as a standby. Replicas outlive their controller
  (the local backend starts them detached).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from modelyard.api.app import create_platform_app
from modelyard.api.control_forward import ControlForward
from modelyard.config import PlatformSettings
from modelyard.control.backends import open_backend
from modelyard.control.backends.base import Backend
from modelyard.control.backends.local import LocalBackend
from modelyard.control.cluster_load import LoadAggregator
from modelyard.control.leader import LeaderLease, LeaseKeeper
from modelyard.control.route_publisher import RoutePublisher
from modelyard.control.takeover import ReplicaTakeover
from modelyard.core.cluster_auth import sign_leader_url, verified_leader_url
from modelyard.core.cluster_keys import LEADER_KEY
from modelyard.gateway.route_mirror import RouteMirror
from modelyard.gateway.traffic_report import TrafficReporter
from modelyard.platform import Platform
from modelyard.store import routing_entries

log = logging.getLogger(__name__)

LOST_LEASE_EXIT = 3


class ClusterConfigError(ValueError):
    """The settings cannot run a cluster role (said in one line)."""


def check_cluster_settings(settings: PlatformSettings) -> None:
    url = settings.database_url or ""
    if not url.startswith(("postgresql", "postgres://")):
        raise ClusterConfigError(
            "cluster roles need PostgreSQL (MODELYARD_DATABASE_URL=postgresql://…): SQLite is "
            "one process's database; use `modelyard serve` for a single process"
        )
    if not settings.redis_url:
        raise ClusterConfigError(
            "cluster roles need Redis (MODELYARD_REDIS_URL=redis://… or redis+sentinel://…) for "
            "limits, quotas and the gateways' load"
        )
    if not settings.cluster_secret:
        raise ClusterConfigError(
            "cluster roles need a shared secret (MODELYARD_CLUSTER_SECRET, the same on every "
            "gateway and controller, e.g. `openssl rand -hex 32`): it signs the leader's "
            "address and authenticates the platform to its workers"
        )


class LeaderAddress:
    """The leading controller's URL from Redis, cached for a second: only a URL signed with
    the cluster secret (`core.cluster_auth`); anything else in the key is no leader at all,
    so control requests, bearer keys and all, never go where a writer of Redis points them."""

    def __init__(self, redis: Any, secret: str) -> None:
        self.redis = redis
        self.secret = secret
        self._url: str | None = None
        self._at = 0.0
        self._refused: bytes | str | None = None  # the last unsigned value (logged once)

    async def get(self) -> str | None:
        if self._url is None or time.monotonic() - self._at > 1.0:
            try:
                value = await self.redis.get(LEADER_KEY)
            except Exception as exc:
                log.warning("reading the leader's address from Redis failed: %s", exc)
                value = None
            self._url = verified_leader_url(self.secret, value)
            if value is not None and self._url is None and value != self._refused:
                log.error(
                    "the leader's address in Redis (%s) is not signed with this cluster's "
                    "secret: ignored (a wrong MODELYARD_CLUSTER_SECRET, or someone wrote it)",
                    LEADER_KEY,
                )
                self._refused = value
            self._at = time.monotonic()
        return self._url

    def forget(self) -> None:
        self._url = None


class _Role:
    platform: Platform

    def app(self, leads: Callable[[], bool]) -> Any:
        p = self.platform
        app = create_platform_app(p.services, self)
        address = LeaderAddress(p._redis, self.settings.cluster_secret or "")
        app.add_middleware(
            ControlForward,
            leads=leads,
            leader_url=address.get,
            forget_leader=address.forget,
            takeover_wait_s=self.settings.controller_lease_s,
        )
        return app

    async def _start_shared(self) -> None:
        p = self.platform
        await asyncio.to_thread(p.db.migrate)
        await asyncio.to_thread(p._secure_files)
        await p.recorder.recover()
        await p._seed_quotas()
        p.recorder.start()
        await p.gateway.start()

    async def _stop_shared(self) -> None:
        p = self.platform
        await p.recorder.stop()
        await p.gateway.stop()
        await p.limiter.close()
        if p._redis is not None:
            await p._redis.aclose()
        p.db.dispose()

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class GatewayRole(_Role):
    """`modelyard gateway`: stateless; any number behind a load balancer."""

    def __init__(self, settings: PlatformSettings) -> None:
        check_cluster_settings(settings)
        self.settings = settings
        # Runs no replica: an inert local backend (never Ray: a gateway joins no Ray cluster).
        self.platform = p = Platform(settings, LocalBackend(settings.data_dir / "logs"))
        self.mirror = RouteMirror(p.db, p.routing, settings.routing_refresh_s)
        self.reporter = TrafficReporter(p._redis, p.routing)
        # Scale from zero goes to the leader through Redis, not to an in-process manager.
        p.gateway.upstream.activate = self.reporter.activate
        p.gateway.upstream.stale_route_wait_s = settings.stale_route_wait_s

    def asgi(self) -> Any:
        return self.app(lambda: False)

    async def start(self) -> None:
        await self._start_shared()
        await self.mirror.start()
        self.reporter.start()

    async def stop(self) -> None:
        await self.reporter.stop()
        await self.mirror.stop()
        await self._stop_shared()


class ControllerRole(_Role):
    """`modelyard controller`: the control plane while it leads; a standby otherwise."""

    def __init__(self, settings: PlatformSettings) -> None:
        check_cluster_settings(settings)
        self.settings = settings
        backend = self._backend(settings)
        # Replicas the previous leader left running are adopted when this one leads.
        self.takeover = ReplicaTakeover(backend)
        p = Platform(settings, backend, takeover=self.takeover)
        self.platform = p
        self.manager = p.endpoints
        host = settings.host if settings.host not in ("0.0.0.0", "::") else socket.getfqdn()
        self.url = settings.advertise_url or f"http://{host}:{settings.port}"
        self.lease = LeaderLease(
            settings.resolved_database_url, lease_s=settings.controller_lease_s
        )
        self.publisher = RoutePublisher(
            p.db, p.routing, self.manager.endpoints, held_back=self.takeover.adopting.__contains__
        )
        self.aggregator = LoadAggregator(p._redis, p.routing, self.manager.activate)
        self.leading = False
        self.on_leading: Callable[[], None] | None = None  # e.g. the CLI's banner
        self._task: asyncio.Task[None] | None = None
        self._takeover: asyncio.Task[None] | None = None
        self.keeper: LeaseKeeper | None = None

    @staticmethod
    def _backend(settings: PlatformSettings) -> Backend:
        """Replicas outlive this controller (its successor adopts them)."""
        log_dir = settings.data_dir / "logs"
        return open_backend(settings, log_dir, None, detached=True)

    def asgi(self) -> Any:
        return self.app(lambda: self.leading)

    async def start(self) -> None:
        await self._start_shared()
        loop = asyncio.get_running_loop()
        self.keeper = LeaseKeeper(
            self.lease,
            on_acquired=lambda: loop.call_soon_threadsafe(self._begin_takeover),
            on_lost=self._exit_lost,
        )
        self.keeper.start()
        self._task = asyncio.create_task(self._keep_advertising(), name="controller-advertise")

    @staticmethod
    def _exit_lost() -> None:
        log.error("this controller lost the leader lease; exiting (its supervisor "
                  "restarts it as a standby)")  # fmt: skip
        os._exit(LOST_LEASE_EXIT)

    def _begin_takeover(self) -> None:
        """On the loop: lead. The lease keeps being checked on its own thread meanwhile."""
        self._takeover = asyncio.create_task(self._take_over_or_exit(), name="takeover")

    async def _take_over_or_exit(self) -> None:
        try:
            await self._take_over()
        except Exception:
            log.exception("taking over as the leader failed; exiting")
            os._exit(LOST_LEASE_EXIT)

    async def _keep_advertising(self) -> None:
        tick = self.settings.controller_lease_s / 3
        while True:
            if self.leading:
                await self._advertise()
            await asyncio.sleep(tick)

    async def _advertise(self) -> None:
        ttl_ms = int(self.settings.controller_lease_s * 1000)
        try:
            value = sign_leader_url(self.settings.cluster_secret or "", self.url)
            await self.platform._redis.set(LEADER_KEY, value, px=ttl_ms)  # type: ignore[union-attr]
        except Exception as exc:
            log.warning("writing the leader's address to Redis failed: %s", exc)

    async def _take_over(self) -> None:
        """Lead: resume from the database (see the module's docstring)."""
        started = time.monotonic()
        p = self.platform
        p.bootstrap = await asyncio.to_thread(p._bootstrap_admin)
        self.takeover.recorded = await asyncio.to_thread(self._recorded)
        await self.manager.start()
        await self.publisher.start()
        self.aggregator.start()
        p.batch_runner.start()
        p.reclaimer.start()
        self.leading = True
        await self._advertise()
        log.info(
            "leading at %s (took over in %.2fs; %d endpoint(s) with running replicas to adopt)",
            self.url, time.monotonic() - started, len(self.takeover.adopting),
        )  # fmt: skip
        if self.settings.default_models:
            p._loading = asyncio.create_task(p._load_in_background())
        else:
            await p._start_warm_pool()
        if self.on_leading is not None:
            self.on_leading()

    def _recorded(self) -> dict[str, list[dict[str, Any]]]:
        with self.platform.db.session() as s:
            return {
                r.endpoint_id: list(r.entry.get("replicas", []))
                for r in routing_entries.newer_than(s, 0)
                if not r.removed and r.entry.get("replicas")
            }

    async def stop(self) -> None:
        if self.keeper is not None:
            await asyncio.to_thread(self.keeper.stop)
        for task in (self._task, self._takeover):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        p = self.platform
        if self.leading:
            self.leading = False
            if p._loading is not None:
                p._loading.cancel()
            await p.batch_runner.stop()
            await p.reclaimer.stop()
            await self.aggregator.stop()
            await self.publisher.stop()
            await p.endpoints.stop()  # its replicas keep running for the next leader
            with contextlib.suppress(Exception):
                advertised = await p._redis.get(LEADER_KEY)  # type: ignore[union-attr]
                if verified_leader_url(self.settings.cluster_secret or "", advertised) == self.url:
                    await p._redis.delete(LEADER_KEY)  # type: ignore[union-attr]
        await asyncio.to_thread(self.lease.release)
        await self._stop_shared()
