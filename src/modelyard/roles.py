"""The cluster's roles, each its own process (`modelyard gateway`, `modelyard controller`), built
from the same parts as `serve` (`platform.Platform`) with the state they share in PostgreSQL and
Redis instead of in memory.

- Gateway: auth, limits and quotas (Redis), metering (PostgreSQL), proxying; its routing table
  is a mirror of the one the leading controller publishes (`gateway/route_mirror.py`), with the
  replicas' prefix digests from Redis (`gateway/digest_mirror.py`). It runs no replica and no
  control loop; control requests go on to the leader (`api/control_forward.py`).
- Controller: the whole control plane, but only while it holds the leader lease
  (`control/leader.py`). A standby tries for the lease every third of `controller_lease_s`; on
  taking it, it resumes from the database: bootstraps the admin key on a first start, adopts the
  replicas its predecessor left running (`control/takeover.py`), publishes the routing
  table and the replicas' prefix digests (`control/digest_publisher.py`), sums the gateways'
  load from Redis for its autoscaler, and runs the batch runner
  (whose item leases make a takeover lose and repeat nothing). A leader that loses its lease
  while running (cut off from the database, paused past the lease) steps down at once: it
  stops answering as the leader, stops its leader-only loops and its advertisement, and stands
  by, trying for the lease again (no supervisor needed). Replicas outlive their controller
  (the local backend starts them detached).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

from modelyard.api.app import create_platform_app
from modelyard.api.control_forward import ControlForward
from modelyard.config import PlatformSettings
from modelyard.control.backends import open_backend
from modelyard.control.backends.base import Backend
from modelyard.control.backends.local import LocalBackend
from modelyard.control.cluster_load import LoadAggregator
from modelyard.control.cluster_outcomes import ClusterOutcomes
from modelyard.control.digest_publisher import DigestPublisher
from modelyard.control.leader import LeaderLease, LeaseKeeper
from modelyard.control.route_publisher import RoutePublisher
from modelyard.control.takeover import ReplicaTakeover
from modelyard.core.cluster_auth import sign_leader_url, verified_leader_url
from modelyard.core.cluster_keys import LEADER_KEY
from modelyard.gateway.digest_mirror import DigestMirror
from modelyard.gateway.leader_address import LeaderAddress
from modelyard.gateway.outcome_report import OutcomeReporter
from modelyard.gateway.route_mirror import RouteMirror
from modelyard.gateway.traffic_report import TrafficReporter
from modelyard.platform import Platform
from modelyard.store import routing_entries

log = logging.getLogger(__name__)

TAKEOVER_FAILED_EXIT = 3  # a takeover that raised: a supervisor may start it afresh


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


class _Role:
    platform: Platform
    settings: PlatformSettings
    outcomes: OutcomeReporter

    def _report_outcomes(self) -> None:
        """This process's gateway adds its per-version outcomes to the cluster's (the leader's
        canary SLO gate sums every gateway's)."""
        p = self.platform
        self.outcomes = OutcomeReporter(p._redis, p.routing)
        p.gateway.upstream.stats.listener = self.outcomes.record

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
            timeout_s=self.settings.control_forward_timeout_s,
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
        self.outcomes.start()

    async def _stop_shared(self) -> None:
        p = self.platform
        await self.outcomes.stop()
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
        # The replicas' prefix digests, which only the leader's health checks read.
        self.digests = DigestMirror(p._redis, p.routing)
        self.reporter = TrafficReporter(p._redis, p.routing)
        # Scale from zero goes to the leader through Redis, not to an in-process manager.
        p.gateway.upstream.activate = self.reporter.activate
        p.gateway.upstream.stale_route_wait_s = settings.stale_route_wait_s
        self._report_outcomes()

    def asgi(self) -> Any:
        return self.app(lambda: False)

    async def start(self) -> None:
        await self._start_shared()
        await self.mirror.start()
        if self.settings.prefix_aware_routing:
            self.digests.start()
        self.reporter.start()

    async def stop(self) -> None:
        await self.reporter.stop()
        await self.digests.stop()
        await self.mirror.stop()
        await self._stop_shared()


class ControllerRole(_Role):
    """`modelyard controller`: the control plane while it leads; a standby otherwise.

    Leading comes in terms: a term starts when the lease is acquired (`_take_over`) and ends
    when it is lost (`_step_down`): the leader-only loops stop, the advertisement goes, the
    replicas keep running for whoever leads next, and this process stands by and tries for the
    lease again. A next term starts from the database with a fresh endpoint manager, as a new
    process would; terms never overlap (one lock orders them)."""

    def __init__(self, settings: PlatformSettings) -> None:
        check_cluster_settings(settings)
        self.settings = settings
        backend = self._backend(settings)
        # Replicas the previous leader left running are adopted when this one leads.
        self.takeover = ReplicaTakeover(backend, settings.test_adopt_delay_s)
        p = Platform(settings, backend, takeover=self.takeover)
        self.platform = p
        # Scale from zero for the batch runner's requests: always the current term's manager.
        p.gateway.upstream.activate = lambda endpoint_id: p.endpoints.activate(endpoint_id)
        self._report_outcomes()
        # The canary's SLO gate judges on every gateway's outcomes, summed from Redis.
        self.cluster_outcomes = ClusterOutcomes(p._redis)
        p.endpoints.versions.read_stats = self.cluster_outcomes.window
        host = settings.host if settings.host not in ("0.0.0.0", "::") else socket.getfqdn()
        self.url = settings.advertise_url or f"http://{host}:{settings.port}"
        self.lease = LeaderLease(
            settings.resolved_database_url, lease_s=settings.controller_lease_s
        )
        self._term_parts()
        self.leading = False
        self.terms = 0  # terms led so far (logs, tests)
        self.on_leading: Callable[[], None] | None = None  # e.g. the CLI's banner
        self._app: Any = None
        self._task: asyncio.Task[None] | None = None
        self._takeover: asyncio.Task[None] | None = None
        self._stepping: asyncio.Task[None] | None = None
        self._term = asyncio.Lock()  # a takeover and a step-down never run at once
        self.keeper: LeaseKeeper | None = None

    def _term_parts(self) -> None:
        p = self.platform
        self.manager = p.endpoints
        self.publisher = RoutePublisher(
            p.db, p.routing, self.manager.endpoints, held_back=self.takeover.adopting.__contains__
        )
        self.aggregator = LoadAggregator(p._redis, p.routing, self.manager.activate)
        self.digests = DigestPublisher(p._redis, p.routing)

    @staticmethod
    def _backend(settings: PlatformSettings) -> Backend:
        """Replicas outlive this controller (its successor adopts them)."""
        log_dir = settings.data_dir / "logs"
        return open_backend(settings, log_dir, None, detached=True)

    def leads(self) -> bool:
        """Acts as the leader now: led, and the lease checked recently enough (a process woken
        from a pause is no leader before its keeper has even looked)."""
        return self.leading and self.lease.is_leader

    def asgi(self) -> Any:
        self._app = self.app(self.leads)
        return self._app

    async def start(self) -> None:
        await self._start_shared()
        loop = asyncio.get_running_loop()
        self.keeper = LeaseKeeper(
            self.lease,
            on_acquired=lambda: _call_soon(loop, self._begin_takeover),
            on_lost=lambda: _call_soon(loop, self._begin_step_down),
        )
        self.keeper.start()
        self.cluster_outcomes.start()
        self._task = asyncio.create_task(self._keep_advertising(), name="controller-advertise")

    def _begin_takeover(self) -> None:
        """On the loop: lead. The lease keeps being checked on its own thread meanwhile."""
        self._takeover = asyncio.create_task(self._take_over_or_exit(), name="takeover")

    def _begin_step_down(self) -> None:
        """On the loop: the lease is lost; stop acting as the leader at once, then stand by."""
        log.error("this controller lost the leader lease: stepping down to standby")
        self.leading = False
        if self._takeover is not None:
            self._takeover.cancel()  # a takeover still under way stops where it is
        self._stepping = asyncio.create_task(self._step_down(), name="step-down")

    async def _take_over_or_exit(self) -> None:
        async with self._term:
            if not self.lease.is_leader:  # lost again before this term could start
                return
            try:
                await self._take_over()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("taking over as the leader failed; exiting")
                os._exit(TAKEOVER_FAILED_EXIT)

    async def _step_down(self) -> None:
        async with self._term:
            started = time.monotonic()
            await self._stop_leading()
            # The next term starts from nothing of this one: an empty table, a fresh manager.
            p = self.platform
            for route in list(p.routing.all_routes()):
                p.routing.remove(route.endpoint_id)
            self.takeover = ReplicaTakeover(p.backend, self.settings.test_adopt_delay_s)
            p.renew_endpoints(self.takeover)
            if self._app is not None:
                self._app.state.services = p.services
            self._term_parts()
            log.warning(
                "stepped down in %.2fs: standing by (trying for the lease every %.1fs)",
                time.monotonic() - started, self.settings.controller_lease_s / 3,
            )  # fmt: skip

    async def _keep_advertising(self) -> None:
        tick = self.settings.controller_lease_s / 3
        while True:
            if self.leads():
                await self._advertise()
            await asyncio.sleep(tick)

    async def _advertise(self) -> None:
        ttl_ms = int(self.settings.controller_lease_s * 1000)
        try:
            value = sign_leader_url(self.settings.cluster_secret or "", self.url)
            await self.platform._redis.set(LEADER_KEY, value, px=ttl_ms)  # type: ignore[union-attr]
        except Exception as exc:
            log.warning("writing the leader's address to Redis failed: %s", exc)

    async def _unadvertise(self) -> None:
        """Take this controller's address out of Redis (only if it is still the one there)."""
        redis: Any = self.platform._redis
        with contextlib.suppress(Exception):
            advertised = await redis.get(LEADER_KEY)
            if verified_leader_url(self.settings.cluster_secret or "", advertised) == self.url:
                await redis.delete(LEADER_KEY)

    async def _take_over(self) -> None:
        """Lead: resume from the database (see the module's docstring)."""
        started = time.monotonic()
        p = self.platform
        self.terms += 1
        p.bootstrap = await asyncio.to_thread(p._bootstrap_admin)
        self.takeover.recorded = await asyncio.to_thread(self._recorded)
        await self.manager.start()
        await self.publisher.start()
        self.aggregator.start()
        if self.settings.prefix_aware_routing:
            self.digests.start()
        p.batch_runner.start()
        p.reclaimer.start()
        self.leading = True
        await self._advertise()
        log.info(
            "leading at %s (term %d; took over in %.2fs; %d endpoint(s) with running replicas "
            "to adopt)", self.url, self.terms, time.monotonic() - started,
            len(self.takeover.adopting),
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

    async def _stop_leading(self) -> None:
        """Stop the leader-only loops; the replicas keep running for the next leader. Each part
        gets a lease to stop: one that does not is left (its stack logged), never the whole
        step-down held."""
        p = self.platform
        self.leading = False
        if p._loading is not None:
            p._loading.cancel()
            p._loading = None
        for what, stopping in (
            ("the batch runner", p.batch_runner.stop()),
            ("the blob reclaimer", p.reclaimer.stop()),
            ("the load aggregator", self.aggregator.stop()),
            ("the digest publisher", self.digests.stop()),
            ("the route publisher", self.publisher.stop()),
            ("the endpoint manager", p.endpoints.stop()),  # its replicas keep running
            ("the advertisement", self._unadvertise()),
        ):
            await _bounded(what, stopping, self.settings.controller_lease_s)

    async def stop(self) -> None:
        if self.keeper is not None:
            await asyncio.to_thread(self.keeper.stop)
        for task in (self._task, self._takeover):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        async with self._term:
            if self.leading:
                await self._stop_leading()
        await asyncio.to_thread(self.lease.release)
        await self.cluster_outcomes.stop()
        await self._stop_shared()


async def _bounded(what: str, stopping: Coroutine[Any, Any, None], within_s: float) -> None:
    task = asyncio.ensure_future(stopping)
    done, _ = await asyncio.wait({task}, timeout=within_s)
    if done:
        if not task.cancelled() and task.exception() is not None:
            log.error("stopping %s failed: %r", what, task.exception())
        return
    stack = io.StringIO()
    task.print_stack(file=stack)
    task.cancel()
    log.error("%s did not stop within %.1fs; left behind:\n%s", what, within_s, stack.getvalue())


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """Run `callback` on `loop` from the lease keeper's thread."""
    loop.call_soon_threadsafe(callback)
