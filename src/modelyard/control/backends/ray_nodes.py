"""The elastic node provider on Ray: nodes asked of Ray's autoscaler, idle ones drained.

A node's class is a custom resource it is started with, `modelyard.node_class.on-demand` or
`modelyard.node_class.spot` (any amount, e.g. `ray start --resources='{"modelyard.node_class.
spot": 1000}'`); a replica asks for a sliver of its class's resource, so Ray puts it only on
such a node, and the autoscaler knows which node type to start for it.

`choose` picks the first class of the replica's preference (`node_provider.preference`) with a
node that has room now, from the cluster's own per-node figures. When none has, `request` adds
the replica's bundles to the standing request to the autoscaler
(`ray.autoscaler.sdk.request_resources`). That call replaces the previous one and asks for a
cluster that *fits* the bundles regardless of what already runs, so the standing request is
every bundle this provider's replicas hold plus every one still waiting: the autoscaler adds
nodes for the waiting ones and keeps those that run. A replica placed moves from waiting to held;
one stopped or lost leaves the request. `tick` (every few seconds, off the event loop) drains a
classed node that held nothing for `node_idle_release_s` while no replica waits for its class,
through Ray's drain API with the idle-termination reason (the one Ray's own autoscaler uses: the
node's raylet accepts only while idle, then leaves the cluster; the autoscaler terminates its
machine).

A node Ray is draining for another reason (a cloud's spot interruption notice reaches Ray as a
drain with the preemption reason and a deadline; any drain but this provider's own idle one)
is *leaving*: `tick` also reads Ray's draining nodes with their deadlines (the GCS's
`get_draining_nodes`, bounded by a timeout), and `draining` says which. Such a node takes no new
work (Ray's doing), so `choose` counts no room on it; the backend moves its replicas off it
(`backends/ray.py`). `ray` is imported only when called.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from modelyard.config import PlatformSettings
from modelyard.control.node_provider import (
    Bundle,
    Choice,
    Node,
    NodeClass,
    Ticket,
    Workload,
    preference,
)

log = logging.getLogger(__name__)

CLASS_RESOURCE_PREFIX = "modelyard.node_class."
CLASS_SHARE = 0.001  # what a replica asks of its node's class resource: a marker, not a limit
_HELD = ("CPU", "GPU", "memory")  # what a replica holds on a node
_EPS = 1e-6
_GCS_TIMEOUT_S = 10.0  # the longest one read of Ray's draining nodes may take


def class_resource(node_class: NodeClass) -> str:
    return CLASS_RESOURCE_PREFIX + node_class.value


def node_class_of(total: dict[str, float]) -> NodeClass | None:
    for node_class in NodeClass:
        if total.get(class_resource(node_class), 0.0) > 0:
            return node_class
    return None


def with_class(bundle: Bundle, node_class: NodeClass | None) -> Bundle:
    """The bundle that lands only on a node of `node_class` (any node for None)."""
    if node_class is None:
        return dict(bundle)
    return {**bundle, class_resource(node_class): CLASS_SHARE}


def _fits(free: dict[str, float], need: Bundle) -> bool:
    return all(free.get(k, 0.0) + _EPS >= v for k, v in need.items())


def _idle(free: dict[str, float], total: dict[str, float]) -> bool:
    keys = [*_HELD, *(class_resource(c) for c in NodeClass)]
    return all(free.get(k, 0.0) + _EPS >= total.get(k, 0.0) for k in keys)


def _per_node() -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    from modelyard.control.backends.ray_room import per_node

    return per_node()


def _request_resources(bundles: list[Bundle]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


def _drain_idle(node_id: str) -> tuple[bool, str]:
    """Ask Ray to drain an idle node (refused when it holds something)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    worker: Any = ray._private.worker.global_worker
    reasons: Any = getattr(autoscaler_pb2, "DrainNodeReason")  # noqa: B009 (generated, untyped)
    reason = reasons.Value("DRAIN_NODE_REASON_IDLE_TERMINATION")
    gcs = worker.gcs_client
    accepted, why = gcs.drain_node(node_id, reason, "modelyard: idle past node_idle_release_s", 0)
    return bool(accepted), str(why)


def _draining_nodes() -> dict[str, float | None]:
    """The nodes Ray is draining (for any reason), by hex id: their deadline in wall-clock
    seconds, None when the drain gave none."""
    import ray

    worker: Any = ray._private.worker.global_worker
    draining: dict[str, int] = worker.gcs_client.get_draining_nodes(timeout=_GCS_TIMEOUT_S)
    return {str(n): (ms / 1000 if ms else None) for n, ms in draining.items()}


class RayNodeProvider:
    """`NodeProvider` on Ray's autoscaler. Every method blocks (Ray's control store): call them
    on a thread."""

    def __init__(
        self, settings: PlatformSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.idle_release_s = settings.node_idle_release_s
        self.spot_policy = settings.spot_policy
        self._clock = clock
        self._lock = threading.Lock()
        self._waiting: dict[str, Ticket] = {}
        self._held: dict[str, list[Bundle]] = {}
        self._published: list[Bundle] | None = None
        self._idle_since: dict[str, float] = {}
        self.released: list[str] = []  # node ids given back, oldest first
        self._draining: dict[str, float | None] = {}  # leaving nodes: their deadline

    @property
    def tick_interval_s(self) -> float:
        # At most 2 s: a spot notice may give 30 s (GCP), and the tick is what reads it.
        return min(2.0, max(0.2, self.idle_release_s / 4))

    def choose(self, workload: Workload, need: Bundle) -> Choice:
        classes = preference(workload, self.spot_policy)
        free, _ = _per_node()
        leaving = self.draining()
        free = {n: room for n, room in free.items() if n not in leaving}
        for node_class in classes:
            shaped = with_class(need, node_class)
            if any(_fits(room, shaped) for room in free.values()):
                return Choice(node_class, True)
        return Choice(classes[0], False)

    def request(
        self, replica_id: str, bundles: list[Bundle], node_class: NodeClass | None
    ) -> Ticket:
        ticket = Ticket(replica_id, node_class, [with_class(b, node_class) for b in bundles])
        with self._lock:
            self._waiting[replica_id] = ticket
            self._publish()
        log.info("asked Ray's autoscaler for a %s node for replica %s", node_class, replica_id)
        return ticket

    def held(self, replica_id: str, bundles: list[Bundle]) -> None:
        with self._lock:
            self._waiting.pop(replica_id, None)
            self._held[replica_id] = [dict(b) for b in bundles]
            self._publish()

    def forget(self, replica_id: str) -> None:
        with self._lock:
            gone = self._waiting.pop(replica_id, None), self._held.pop(replica_id, None)
            if gone != (None, None):
                self._publish()

    def waiting(self) -> list[Ticket]:
        with self._lock:
            return list(self._waiting.values())

    def _publish(self) -> None:
        """The standing request: every held bundle and every waiting one (caller holds the lock)."""
        bundles = [b for held in self._held.values() for b in held]
        bundles += [b for t in self._waiting.values() for b in t.bundles]
        if bundles != self._published:
            _request_resources(bundles)
            self._published = bundles

    def draining(self) -> dict[str, float | None]:
        """The nodes Ray is taking away (not this provider's idle drains), as of the last tick:
        their deadline (wall-clock seconds), None when none was given."""
        with self._lock:
            return dict(self._draining)

    def nodes(self) -> list[Node]:
        free, total = _per_node()
        return [
            Node(n, node_class_of(total[n]), _idle(free.get(n, {}), total[n]))
            for n in sorted(total)
        ]

    def release(self, node_id: str) -> bool:
        accepted, why = _drain_idle(node_id)
        if accepted:
            self.released.append(node_id)
            log.info("released idle Ray node %s", node_id[:12])
        else:
            log.info("Ray node %s not released: %s", node_id[:12], why)
        return accepted

    def tick(self) -> list[str]:
        """Note the nodes Ray is draining (`draining`); release the classed nodes idle past the
        delay whose class no replica waits for."""
        mine = set(self.released)
        leaving = {n: d for n, d in _draining_nodes().items() if n not in mine}
        with self._lock:
            new = leaving.keys() - self._draining.keys()
            self._draining = leaving
        for node_id in sorted(new):
            deadline = leaving[node_id]
            left = "no deadline" if deadline is None else f"{deadline - time.time():.0f}s left"
            log.warning("Ray is draining node %s (%s): moving off it", node_id[:12], left)
        now = self._clock()
        wanted = {t.node_class for t in self.waiting()}
        nodes = self.nodes()
        released: list[str] = []
        for node in nodes:
            idle = node.idle and node.node_id not in leaving
            if node.node_class is None or not idle or node.node_class in wanted:
                self._idle_since.pop(node.node_id, None)
                continue
            since = self._idle_since.setdefault(node.node_id, now)
            if now - since >= self.idle_release_s and self.release(node.node_id):
                released.append(node.node_id)
                del self._idle_since[node.node_id]
        alive = {n.node_id for n in nodes}
        for node_id in [n for n in self._idle_since if n not in alive]:
            del self._idle_since[node_id]
        return released


async def tick_forever(
    nodes: RayNodeProvider,
    where: Callable[[], dict[str, str | None]],
    leaving: dict[str, float | None],
) -> None:
    """The provider's tick (a task of the backend's, cancelled when it stops): Ray's calls on a
    thread, then `leaving` (kept up to date in place) is the replicas on a node Ray is draining,
    from `where` (replica id: its node), with the node's deadline. A replica newly leaving
    leaves the standing request: the autoscaler is to replace its room, not keep it."""
    while True:
        try:
            await asyncio.to_thread(nodes.tick)
            draining = nodes.draining()
            now = {i: draining[n] for i, n in where().items() if n is not None and n in draining}
            for replica_id in sorted(now.keys() - leaving.keys()):
                log.warning("replica %s is on a node Ray is draining: it is to move", replica_id)
                await asyncio.to_thread(nodes.forget, replica_id)
            leaving.clear()
            leaving.update(now)
        except Exception:  # Ray briefly unreachable: the next tick tries again
            log.exception("the node provider's tick failed")
        await asyncio.sleep(nodes.tick_interval_s)
