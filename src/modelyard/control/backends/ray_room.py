"""Why Ray has not placed a replica yet: no node has the resources it asks for free.

Read from the cluster's own figures (each node's free and total resources, as the Ray driver
sees them), off the event loop; said in words for the endpoint's owner, with counts only (what
holds the room may be other tenants' replicas); `wait_placed` tells it while a start waits.
`ray` is imported only when called.
"""

from __future__ import annotations

import asyncio
from typing import Any

from modelyard.control.backends.base import Waiting

# While a replica waits for Ray to place it, how often the backend looks why (room).
_ROOM_POLL_S = 1.0


def per_node() -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """(free, total) resources of every alive node, as this Ray driver sees them."""
    from ray._private import state

    free = state.available_resources_per_node()  # type: ignore[no-untyped-call]
    total = state.total_resources_per_node()  # type: ignore[no-untyped-call]
    return free, total


def _number(resource: str, value: float) -> str:
    return f"{value / 2**30:.1f}" if resource == "memory" else f"{value:g}"


def _unit(resource: str) -> str:
    return {"memory": "GiB of memory"}.get(resource, resource)


def needs(actor: dict[str, Any], bundles: list[dict[str, float]]) -> dict[str, float]:
    """What one node must have free for the replica: its actor's request, or (tensor
    parallel) the sum of its bundles, which STRICT_PACK puts on one node."""
    if bundles:
        summed: dict[str, float] = {}
        for bundle in bundles:
            for k, v in bundle.items():
                summed[k] = summed.get(k, 0.0) + v
        return {k: v for k, v in summed.items() if v > 0}
    need = {"CPU": float(actor.get("num_cpus", 0)), "GPU": float(actor.get("num_gpus", 0))}
    if actor.get("memory"):
        need["memory"] = float(actor["memory"])
    return {k: v for k, v in need.items() if v > 0}


def explain(
    need: dict[str, float],
    free: dict[str, dict[str, float]],
    total: dict[str, dict[str, float]],
) -> str | None:
    """Why no node fits `need` (None: one does, the replica is only being placed)."""
    if any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in free.values()):
        return None
    # The resource that most blocks it: the one fewest nodes have enough of.
    short = min(need, key=lambda k: sum(node.get(k, 0.0) >= need[k] for node in free.values()))
    in_use = sum(total[n].get(short, 0.0) - free.get(n, {}).get(short, 0.0) for n in total)
    whole = sum(node.get(short, 0.0) for node in total.values())
    asked = " and ".join(f"{_number(k, v)} {_unit(k)}" for k, v in need.items())
    nodes = f"{len(total)} node" + ("s" if len(total) != 1 else "")
    return (
        f"waiting for room on Ray: no node has {asked} free ({_number(short, in_use)} of "
        f"{_number(short, whole)} {_unit(short)} in use on {nodes})"
    )


def no_room(actor: dict[str, Any], bundles: list[dict[str, float]]) -> str | None:
    """Why Ray cannot place this replica now (None: it can, or the figures are unreadable)."""
    try:
        free, total = per_node()
    except Exception:  # an older or newer Ray without these figures: no reason, no harm
        return None
    return explain(needs(actor, bundles), free, total)


async def wait_placed(
    placed: Any,
    actor: dict[str, Any],
    bundles: list[dict[str, float]],
    deadline: float,
    waiting: Waiting | None,
) -> None:
    """Until Ray has placed the actor (or group) `placed` resolves for; meanwhile, every
    `_ROOM_POLL_S`, `waiting` is told why not when no node has the room (`no_room` for `actor`
    and `bundles`; TimeoutError at `deadline`, the loop's time)."""
    loop = asyncio.get_running_loop()
    pending = asyncio.ensure_future(placed)
    told: str | None = None
    try:
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            done, _ = await asyncio.wait({pending}, timeout=min(_ROOM_POLL_S, left))
            if done:
                pending.result()
                return
            if waiting is None:
                continue
            why = await asyncio.to_thread(no_room, actor, bundles)
            if why is not None and why != told:
                told = why
                await waiting(why)
    finally:
        pending.cancel()
