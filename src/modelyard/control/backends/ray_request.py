"""What one replica asks Ray for: the resources of the devices placement reserved for it, on a
node of the class its node provider chose.

A CPU core for its process, its GPUs (`num_gpus`) or, on a CPU device, its memory budget
(`memory`), and for a tensor-parallel replica one bundle per rank (a `STRICT_PACK` placement
group: its ranks are processes of one worker, so on one node). With a node class, a sliver of
the class's custom resource (`ray_nodes.with_class`) keeps it to nodes of that class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelyard.control.backends.base import ReplicaSpec
from modelyard.control.backends.ray_nodes import with_class
from modelyard.control.backends.ray_room import needs
from modelyard.control.node_provider import Bundle, NodeClass


@dataclass(frozen=True)
class RayRequest:
    """What to ask Ray for one replica: the host actor's options, and for a tensor-parallel
    replica the placement group's bundles (the host takes bundle 0, rank holders the rest)."""

    actor: dict[str, Any]
    bundles: list[dict[str, float]] = field(default_factory=list)


def ray_request(spec: ReplicaSpec, node_class: NodeClass | None = None) -> RayRequest:
    """Ray resources for the devices placement reserved for `spec`, on a node of `node_class`
    (any node for None)."""
    per_rank: dict[str, float] = {"CPU": 1.0}
    if spec.device_kind == "cuda":
        per_rank["GPU"] = 1.0
    elif spec.device_bytes > 0:  # a CPU "device" is a memory budget
        per_rank["memory"] = float(spec.device_bytes)
    actor: dict[str, Any] = {"num_cpus": 1, "num_gpus": per_rank.get("GPU", 0)}
    if "memory" in per_rank:
        actor["memory"] = int(per_rank["memory"])
    if node_class is not None:
        actor["resources"] = with_class({}, node_class)
    if spec.device_count <= 1:
        return RayRequest(actor)
    return RayRequest(actor, [with_class(per_rank, node_class) for _ in range(spec.device_count)])


def request_bundles(request: RayRequest) -> list[Bundle]:
    """What the replica holds on its node, as bundles for the autoscaler."""
    if request.bundles:
        return [dict(b) for b in request.bundles]
    return [{**needs(request.actor, []), **request.actor.get("resources", {})}]
