"""Replica health: each tick's probe of every serving replica, and what a failure does.

One whose process exited leaves routing and is replaced (with backoff), and what the backend
still holds of it is removed (on Ray, its actor); one whose probe fails
(an error answer, no answer within `health_probe_timeout_s`, refused) leaves routing at once and
comes back when a probe passes, and after `replica_health_failures` failed probes in a row it is
killed (SIGTERM, then SIGKILL) and replaced, so a hung or broken engine never holds its slot for
good. A healthy probe also brings the replica's load report and its admission limit.

`ReplicaHealth` is a collaborator of `ReplicaController` (control/replicas.py): it probes and
takes replicas out, and returns the ones it took out; the controller gives back their devices.
"""

from __future__ import annotations

import logging

import httpx

from modelyard.config import PlatformSettings
from modelyard.control.backends.base import Backend
from modelyard.control.state import EndpointState, Replica
from modelyard.core.prefix_keys import decode_digest
from modelyard.core.routing import CapacityReport, RoutingTable
from modelyard.core.status import ReplicaState

log = logging.getLogger(__name__)

# A replica being replaced for failing its probes gets this long to exit on SIGTERM before
# SIGKILL: it is broken or hung, there is nothing to drain.
_BROKEN_STOP_TIMEOUT_S = 1.0


def capacity_report(replica: Replica) -> CapacityReport | None:
    """The free slots and KV tokens of the replica's load report, bounded by what an engine
    can hold (None where its engine does not report them)."""
    load, route = replica.load or {}, replica.route
    slots, kv = load.get("free_slots"), load.get("kv_free_tokens")
    if route is None or not isinstance(slots, int) or not isinstance(kv, int):
        return None
    total = load.get("kv_cache_capacity_tokens")
    total = min(max(total, 0), 1 << 40) if isinstance(total, int) else 1 << 40
    return CapacityReport(
        min(max(slots, 0), 1 << 20), min(max(kv, 0), total), route.outstanding, total
    )


class ReplicaHealth:
    """Probes replicas and takes the dead and the broken out of routing (and stops them)."""

    def __init__(
        self,
        settings: PlatformSettings,
        backend: Backend,
        routing: RoutingTable,
        http: httpx.AsyncClient,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.routing = routing
        self._http = http

    async def probe(self, replica: Replica, state: EndpointState | None = None) -> str | None:
        """Health check; keeps the replica's load report and sets its admission limit. None if
        healthy, else what failed (for the endpoint's status; no addresses in it)."""
        assert replica.handle is not None
        try:
            r = await self._http.get(replica.handle.url + "/health")
        except httpx.TimeoutException:
            return (
                f"did not answer its health check within {self.settings.health_probe_timeout_s:g}s"
            )
        except httpx.HTTPError as exc:
            return f"health check failed ({type(exc).__name__})"
        if r.status_code != 200:
            try:
                error = r.json().get("error")
            except ValueError:
                error = None
            return f"health check answered {r.status_code}" + (f": {error}" if error else "")
        replica.load = r.json()
        report = replica.load.pop("prefix_digest", None)
        if replica.route is not None and isinstance(report, dict):
            # What its prefix cache holds, for cache-aware routing (`core/cache_routing.py`).
            held = decode_digest(report.get("keys"))
            generation = report.get("generation")
            if held is not None and isinstance(generation, int):
                replica.route.cache.update(held, generation)
        capacity = int(replica.load.get("kv_cache_capacity_tokens") or 0)
        if replica.route is not None and capacity:
            # The spec's admission formula: KV memory / the KV one request needs on average,
            # capped by a runtime's parallel slots (llama.cpp) when it reports them.
            per_request = self.settings.admission_tokens_per_request
            limit = max(1, capacity // per_request)
            slots = int(replica.load.get("max_concurrency") or 0)
            self.routing.set_capacity(replica.route, min(limit, slots) if slots else limit)
        if replica.route is not None and state is not None:
            self.routing.set_report(state.route, replica.route, capacity_report(replica))
        return None

    async def check(self, state: EndpointState) -> list[Replica]:
        """Probe every serving replica: the dead leave and are replaced, a failing one leaves
        routing at once and is killed and replaced after `replica_health_failures` failures in
        a row, the rest report their load. Returns the replicas taken out (stopped, their
        devices still held: the caller releases them)."""
        replaced: list[Replica] = []
        for replica in list(state.replicas):
            if replica.state not in (ReplicaState.READY, ReplicaState.UNHEALTHY):
                continue
            if replica.handle is None:
                continue
            if not self.backend.alive(replica.handle):
                code = self.backend.exit_status(replica.handle)
                await self._replace(state, replica, f"exited with code {code}")
                replaced.append(replica)
                continue
            problem = await self.probe(replica, state)
            if problem is None:
                # Also re-admits a replica the gateway benched after failing to connect to it.
                replica.health_failures = 0
                replica.state = ReplicaState.READY
                replica.error = None
                if replica.route is not None:
                    self.routing.readmit(replica.route, state.route)
                continue
            replica.health_failures += 1
            if not self.backend.alive(replica.handle):  # it died while being probed
                code = self.backend.exit_status(replica.handle)
                await self._replace(state, replica, f"exited with code {code}")
                replaced.append(replica)
            elif replica.health_failures >= self.settings.replica_health_failures:
                await self._replace(
                    state, replica, f"{problem} ({replica.health_failures} times in a row)"
                )
                replaced.append(replica)
            else:
                # No new requests until a probe passes: a request sent there would hang or fail.
                replica.state = ReplicaState.UNHEALTHY
                replica.error = f"replica {replica.replica_id} {problem}"
                if replica.route is not None:
                    self.routing.mark_unready(replica.route, state.route)
        state.replicas = [
            r for r in state.replicas if r.state not in (ReplicaState.FAILED, ReplicaState.STOPPED)
        ]
        return replaced

    async def _replace(self, state: EndpointState, replica: Replica, why: str) -> None:
        """Take a dead or broken replica out for good (killed if it still runs); `converge`
        starts its replacement, with the restart backoff."""
        replica.state = ReplicaState.FAILED
        state.failures += 1
        replica.error = state.last_error = f"replica {replica.replica_id} {why}"
        if replica.route is not None:
            self.routing.drop_replica(state.route, replica.route)
        log.warning("replica %s of %s replaced: %s", replica.replica_id, state.row.id, why)
        if replica.handle is not None:
            # Dead or alive: a dead one's remains go too (on Ray its actor, which holds a CPU,
            # and its placement group). A live one gets SIGTERM, then SIGKILL: a stopped
            # (SIGSTOP) or wedged process ignores the first.
            await self.backend.stop(replica.handle, timeout_s=_BROKEN_STOP_TIMEOUT_S)
