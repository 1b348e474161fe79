"""Where nodes come from: the interface behind placement, and the static provider (today's).

A provider says which class of node a replica should go to (`choose`), is asked for a node when
no node of that class has room (`request`, which returns a ticket), is told when the replica
holds its room and when it gives it back (`held`, `forget`), releases a node (`release`),
lists the nodes with their class (`nodes`) and says which nodes the cluster is taking away
(`draining`: a spot interruption notice, with its deadline). Classes are `on-demand` and
`spot`; which replicas may use spot is the `spot_policy` setting (`preference`). The static
provider is the fixed fleet: it never asks for or releases a node, and knows of no notice. The
elastic one asks Ray's autoscaler (`backends/ray_nodes.py`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

Bundle = dict[str, float]


class NodeClass(enum.StrEnum):
    ON_DEMAND = "on-demand"
    SPOT = "spot"


class Workload(enum.StrEnum):
    """What a replica serves: real-time traffic, or only batch work (`hardware.workload`)."""

    REAL_TIME = "real-time"
    BATCH = "batch"


def preference(workload: Workload, spot_policy: str) -> list[NodeClass]:
    """The node classes a replica may go to, best first: batch work spot first (unless spot is
    never used), real-time on-demand first and spot only with the `overflow` policy."""
    spot = [] if spot_policy == "never" else [NodeClass.SPOT]
    if workload is Workload.BATCH:
        return [*spot, NodeClass.ON_DEMAND]
    return [NodeClass.ON_DEMAND, *(spot if spot_policy == "overflow" else [])]


@dataclass(frozen=True)
class Node:
    node_id: str
    node_class: NodeClass | None  # None: a node without a class (e.g. a Ray head)
    idle: bool  # holds nothing


@dataclass(frozen=True)
class Ticket:
    """A request for room of one class: the bundles of the replica that found none."""

    replica_id: str
    node_class: NodeClass | None
    bundles: list[Bundle] = field(default_factory=list)


@dataclass(frozen=True)
class Choice:
    node_class: NodeClass | None  # None: any node (the static provider)
    room: bool  # a node of that class has room now; else a node is to be requested


class NodeProvider(Protocol):
    def choose(self, workload: Workload, need: Bundle) -> Choice:
        """The class a replica needing `need` on one node goes to (blocking: a thread's)."""
        ...

    def request(
        self, replica_id: str, bundles: list[Bundle], node_class: NodeClass | None
    ) -> Ticket:
        """Ask for a node with room for the replica's bundles (blocking: a thread's)."""
        ...

    def held(self, replica_id: str, bundles: list[Bundle]) -> None:
        """The replica holds its room (it was placed, or adopted); its ticket is done."""
        ...

    def forget(self, replica_id: str) -> None:
        """The replica gave its room back (stopped, lost, failed to start)."""
        ...

    def release(self, node_id: str) -> bool:
        """Give a node back; False when it was not (it holds something, or cannot be)."""
        ...

    def nodes(self) -> list[Node]: ...

    def draining(self) -> dict[str, float | None]:
        """Nodes being taken away (a spot notice), by id: their deadline in wall-clock seconds
        (None: none given). What the provider last learnt: never blocks."""
        ...


class StaticNodeProvider:
    """The fixed fleet: every replica goes to whatever node has room, nothing is requested or
    released."""

    def choose(self, workload: Workload, need: Bundle) -> Choice:
        return Choice(None, True)

    def request(
        self, replica_id: str, bundles: list[Bundle], node_class: NodeClass | None
    ) -> Ticket:
        return Ticket(replica_id, node_class, bundles)

    def held(self, replica_id: str, bundles: list[Bundle]) -> None:
        return None

    def forget(self, replica_id: str) -> None:
        return None

    def release(self, node_id: str) -> bool:
        return False

    def nodes(self) -> list[Node]:
        return []

    def draining(self) -> dict[str, float | None]:
        return {}
