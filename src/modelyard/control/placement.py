"""Where replicas go: memory sizing of a replica and best-fit-decreasing placement onto devices.

A replica needs its weights (after quantization) + its KV cache budget + overhead on every device
it uses; a replica over several devices (tensor-parallel ranks) needs that much on each of
`device_count` devices of one node. A batch of requests is placed largest first, each onto the
device with the least free memory that still fits (best fit decreasing), so small models pack
onto shared devices and empty devices stay free for big models. Replicas of one endpoint go to
different nodes until they cover two (availability), never share a device while another device
fits, and otherwise fill space on devices already in use before opening an empty one (an empty
device is one that can be given back); spreading never makes a request unschedulable. A request
may name devices to avoid (where its last load failed); they are used only if nothing else fits.
Ties break by node, kind, then index, so placement is deterministic. On scale-down,
`drain_order` names the replicas whose removal empties whole devices, since holes left in many
devices keep them all provisioned.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from modelyard.control.devices import Device

GiB = 2**30
MiB = 2**20
DEFAULT_OVERHEAD_BYTES = 512 * MiB  # CUDA context, activations and allocator slack per device
_SPREAD_NODES = 2  # an endpoint's replicas cover this many nodes before they fill holes
_BITS = (32, 16, 8, 4)


def weights_bytes(num_params: int, bits: int) -> int:
    """Bytes of `num_params` weights stored at `bits` per weight (32/16/8/4)."""
    if bits not in _BITS:
        raise ValueError(f"bits must be one of {', '.join(map(str, _BITS))}, not {bits}")
    if num_params < 0:
        raise ValueError("num_params must not be negative")
    return (num_params * bits + 7) // 8


def replica_memory(
    weights_bytes: int, kv_cache_bytes: int, overhead_bytes: int = DEFAULT_OVERHEAD_BYTES
) -> int:
    """What one replica occupies on a device: weights + KV cache budget + overhead."""
    if min(weights_bytes, kv_cache_bytes, overhead_bytes) < 0:
        raise ValueError("sizes must not be negative")
    return weights_bytes + kv_cache_bytes + overhead_bytes


def max_concurrency(device_memory: int, model_bytes: int, avg_kv_bytes_per_request: int) -> int:
    """Admission limit: (device memory - model size) / average KV cache per request, at least 1.

    The spec's example: (80 GB - 35 GB) / 4 GB = 11 requests in flight.
    """
    if avg_kv_bytes_per_request <= 0:
        raise ValueError("avg_kv_bytes_per_request must be positive")
    return max(1, (device_memory - model_bytes) // avg_kv_bytes_per_request)


@dataclass(frozen=True)
class ReplicaRequest:
    """One replica to place; `memory_bytes` is needed on each of its `device_count` devices."""

    replica_id: str
    endpoint_id: str
    memory_bytes: int
    device_count: int = 1
    kind: str | None = None  # only devices of this kind; None: any (one kind per replica)
    # Devices (qualified names) to keep off if anything else fits, e.g. where a load just failed.
    avoid: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"replica {self.replica_id}: memory_bytes must be positive")
        if self.device_count < 1:
            raise ValueError(f"replica {self.replica_id}: device_count must be at least 1")

    @property
    def total_bytes(self) -> int:
        return self.memory_bytes * self.device_count


@dataclass
class PlacementResult:
    assignments: dict[str, list[Device]] = field(default_factory=dict)
    unschedulable: dict[str, str] = field(default_factory=dict)  # replica_id -> why


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _order(device: Device) -> tuple[str, str, int]:
    return (device.node, device.kind, device.index)


@dataclass
class Placement:
    """The allocations on a fixed set of devices; `place` and `release` change them."""

    devices: list[Device]
    # Internally a device is its position in `devices` (sorted by node, kind, index), so the
    # hot paths compare and hash small ints, and position order is the tie-break order.
    _pos: dict[Device, int] = field(init=False, repr=False)
    _free: list[int] = field(init=False, repr=False)
    _on_device: list[set[str]] = field(init=False, repr=False)
    _replicas: dict[str, tuple[ReplicaRequest, list[int]]] = field(init=False, repr=False)
    # (free bytes, position) for every device, ascending: best fit is a bisect away.
    _by_free: list[tuple[int, int]] = field(init=False, repr=False)
    # Replicas of each endpoint per node and per device, for spreading.
    _endpoint_nodes: dict[str, Counter[str]] = field(init=False, repr=False)
    _endpoint_devices: dict[str, Counter[int]] = field(init=False, repr=False)
    _occupied: int = field(init=False, repr=False)
    _single_node: bool = field(init=False, repr=False)
    _largest: int = field(init=False, repr=False)  # memory of the largest device

    def __post_init__(self) -> None:
        self.devices = sorted(self.devices, key=_order)
        keys = [_order(d) for d in self.devices]
        for a, b in itertools.pairwise(keys):
            if a == b:
                raise ValueError(f"device {b[0]}/{b[1]}:{b[2]} is listed twice")
        self._pos = {d: i for i, d in enumerate(self.devices)}
        self._free = [d.memory_bytes for d in self.devices]
        self._on_device = [set() for _ in self.devices]
        self._replicas = {}
        self._by_free = sorted((d.memory_bytes, i) for i, d in enumerate(self.devices))
        self._endpoint_nodes = {}
        self._endpoint_devices = {}
        self._occupied = 0
        self._single_node = len({d.node for d in self.devices}) <= 1
        self._largest = max((d.memory_bytes for d in self.devices), default=0)

    # -- reading -----------------------------------------------------------------------------

    def label(self, device: Device) -> str:
        """`cuda:0` on a single node, `node/cuda:0` when the devices span several."""
        return device.name if self._single_node else device.qualified_name

    def free_bytes(self, device: Device) -> int:
        return self._free[self._pos[device]]

    def usage(self) -> dict[str, tuple[int, int]]:
        """Per device label: (used bytes, total bytes)."""
        return {
            self.label(d): (d.memory_bytes - self._free[i], d.memory_bytes)
            for i, d in enumerate(self.devices)
        }

    def replicas_on(self, device: Device) -> list[str]:
        return sorted(self._on_device[self._pos[device]])

    def assignment(self, replica_id: str) -> list[Device] | None:
        placed = self._replicas.get(replica_id)
        return [self.devices[i] for i in placed[1]] if placed else None

    def request(self, replica_id: str) -> ReplicaRequest | None:
        """What a placed replica asked for (a cluster backend asks its scheduler for the same)."""
        placed = self._replicas.get(replica_id)
        return placed[0] if placed else None

    def drain_order(self, replica_ids: list[str]) -> list[str]:
        """Which of these placed replicas to remove first when scaling down: the one leaving the
        least behind on its devices, so removals empty whole devices instead of punching holes
        in many (ties keep the given order)."""

        def left_behind(replica_id: str) -> int:
            req, chosen = self._replicas[replica_id]
            return sum(
                self.devices[i].memory_bytes - self._free[i] - req.memory_bytes for i in chosen
            )

        return sorted(replica_ids, key=left_behind)

    @property
    def occupied_devices(self) -> int:
        """How many devices hold at least one replica (the ones that must be provisioned)."""
        return self._occupied

    # -- changing ----------------------------------------------------------------------------

    def place(self, requests: list[ReplicaRequest]) -> PlacementResult:
        """Place a batch largest first; what does not fit is reported and changes nothing."""
        counts = Counter(r.replica_id for r in requests)
        dupes = sorted(i for i, n in counts.items() if n > 1 or i in self._replicas)
        if dupes:
            raise ValueError(f"replicas already placed or listed twice: {', '.join(dupes)}")
        result = PlacementResult()
        # Largest footprint first; gangs before single devices of the same footprint because
        # they need several free devices on one node, which small replicas would fragment.
        for req in sorted(requests, key=lambda r: (-r.total_bytes, -r.device_count)):
            chosen, reason = self._choose(req)
            if chosen is None and req.avoid:  # the avoided devices are better than none
                chosen, reason = self._choose(replace(req, avoid=frozenset()))
            if chosen is None:
                result.unschedulable[req.replica_id] = reason
                continue
            self._commit(req, chosen)
            result.assignments[req.replica_id] = [self.devices[i] for i in chosen]
        return result

    def release(self, replica_id: str) -> list[Device]:
        """Free a replica's memory; returns the devices it held."""
        req, chosen = self._replicas.pop(replica_id)
        nodes = self._endpoint_nodes[req.endpoint_id]
        per_device = self._endpoint_devices[req.endpoint_id]
        for i in chosen:
            self._move(i, -req.memory_bytes)
            self._on_device[i].discard(replica_id)
            if not self._on_device[i]:
                self._occupied -= 1
            per_device[i] -= 1
            nodes[self.devices[i].node] -= 1
        if nodes.total() == 0:
            del self._endpoint_nodes[req.endpoint_id]
            del self._endpoint_devices[req.endpoint_id]
        return [self.devices[i] for i in chosen]

    # -- internals ---------------------------------------------------------------------------

    def _move(self, i: int, delta: int) -> None:
        old = self._free[i]
        del self._by_free[bisect.bisect_left(self._by_free, (old, i))]
        self._free[i] = old - delta
        bisect.insort(self._by_free, (old - delta, i))

    def _commit(self, req: ReplicaRequest, chosen: list[int]) -> None:
        self._replicas[req.replica_id] = (req, chosen)
        nodes = self._endpoint_nodes.setdefault(req.endpoint_id, Counter())
        per_device = self._endpoint_devices.setdefault(req.endpoint_id, Counter())
        for i in chosen:
            self._move(i, req.memory_bytes)
            if not self._on_device[i]:
                self._occupied += 1
            self._on_device[i].add(req.replica_id)
            per_device[i] += 1
            nodes[self.devices[i].node] += 1

    def _choose(self, req: ReplicaRequest) -> tuple[list[int] | None, str]:
        return self._best_device(req) if req.device_count == 1 else self._best_gang(req)

    def _candidates(self, req: ReplicaRequest) -> Iterator[tuple[int, int]]:
        """(free, position) of every device with room for `req`, least free first."""
        by_free = self._by_free
        for k in range(bisect.bisect_left(by_free, (req.memory_bytes, -1)), len(by_free)):
            free, i = by_free[k]
            device = self.devices[i]
            if req.kind is not None and device.kind != req.kind:
                continue
            if req.avoid and device.qualified_name in req.avoid:
                continue
            yield free, i

    def _best_device(self, req: ReplicaRequest) -> tuple[list[int] | None, str]:
        nodes = self._endpoint_nodes.get(req.endpoint_id)
        per_device = self._endpoint_devices.get(req.endpoint_id)
        best: tuple[int, ...] | None = None
        for free, i in self._candidates(req):
            if nodes is None or per_device is None:
                best = (0, 0, 0, 0, free, i)
                break  # the endpoint's first replica: plain best fit
            node = self.devices[i].node
            rank = (
                # Availability first: the first replicas go to different nodes...
                int(nodes[node] > 0 and len(nodes) < _SPREAD_NODES),
                per_device[i],  # ...and never two on one device while another has room;
                int(not self._on_device[i]),  # then fill holes before opening a device,
                nodes[node],  # spread over nodes among those,
                free,  # and best fit.
                i,
            )
            if best is None or rank < best:
                best = rank
            if best[:4] == (0, 0, 0, 0):
                break  # nothing later can beat a clean, occupied device with less free memory
            if best[:4] <= (0, 0, 1, 0) and not self._on_device[i] and free >= self._largest:
                break  # only empty devices are left, none better than the best one seen
        if best is None:
            return None, self._no_room(req)
        return [best[-1]], ""

    def _no_room(self, req: ReplicaRequest) -> str:
        for free, i in reversed(self._by_free):
            if req.kind is None or self.devices[i].kind == req.kind:
                return (
                    f"needs {_gib(req.memory_bytes)}; the largest free space is {_gib(free)} "
                    f"on {self.label(self.devices[i])}"
                )
        return f"needs {_gib(req.memory_bytes)}; there is no {req.kind} device"

    def _best_gang(self, req: ReplicaRequest) -> tuple[list[int] | None, str]:
        nodes = self._endpoint_nodes.get(req.endpoint_id, Counter())
        per_device = self._endpoint_devices.get(req.endpoint_id, Counter())
        # Ranks of one replica stay on one node and on one kind of device.
        groups: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
        for free, i in self._candidates(req):
            d = self.devices[i]
            groups.setdefault((d.node, d.kind), []).append((per_device[i], free, i))
        best: tuple[tuple[int, int, int, int], list[int]] | None = None
        for (node, _), fits in groups.items():
            if len(fits) < req.device_count:
                continue
            chosen = sorted(fits)[: req.device_count]  # spread-clean, then best fit, then order
            rank = (
                nodes[node],
                sum(c[0] for c in chosen),
                sum(c[1] for c in chosen),
                min(c[2] for c in chosen),
            )
            if best is None or rank < best[0]:
                best = (rank, sorted(c[2] for c in chosen))
        if best is None:
            most = max((len(f) for f in groups.values()), default=0)
            return None, (
                f"needs {req.device_count} devices with {_gib(req.memory_bytes)} free on one "
                f"node; the best node has {most}"
            )
        return best[1], ""
