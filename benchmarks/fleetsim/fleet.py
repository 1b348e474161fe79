"""One simulated fleet: its devices and replicas, and the platform's control loop over them.

The platform's own pieces are imported, not copied: `Placement` puts every replica on devices,
`scale_down_order` picks which replicas a scale-down drops, and per endpoint a `LoadTracker`
turns the gateway's counters (a route: requests so far, in flight, queued) into the policy's
metric and an `Autoscaler` decides the replica count every 2 s, as the endpoint manager's tick
does. A request for an endpoint with no replica starts one at once (the gateway's Activate).

Replica lifecycle: placed (its devices provisioned) -> loading for the cold-start time
(`Service.cold_start_s`: node cache hit or miss, LRU per node) -> ready (serves) -> on
scale-down drained for one tick, then its memory freed. A device stays provisioned
`release_delay_s` after its last replica leaves (a node: while any of its devices is).
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import numpy as np

from fleetsim.metrics import Counters
from fleetsim.service import DEVICES_PER_NODE, NODE_CACHE_BYTES, Service
from fleetsim.workload import TICK_S
from modelyard.control.autoscaler import Autoscaler, ScalingPolicy
from modelyard.control.devices import inventory
from modelyard.control.placement import Placement, ReplicaRequest
from modelyard.control.replicas import scale_down_order
from modelyard.control.scaling import LoadTracker
from modelyard.control.state import Replica
from modelyard.core.status import ReplicaState

AWAKE = -(1 << 62)  # `Fleet.asleep_since` of an endpoint observed every tick
HISTORY = 64  # ticks of observations kept for sleepers to replay (> `Fleet._replay`)


@dataclass(frozen=True)
class Policy:
    """What a fleet variant does; the defaults are the platform's defaults."""

    autoscale: bool = True
    scale_to_zero: bool = True
    one_per_device: bool = False
    target: float = 0.7  # per replica: this share of its slots in flight
    idle_to_zero_s: float = 300.0
    scale_down_delay_s: float = 30.0
    max_replicas: int = 64
    cold_scale: float = 1.0
    release_delay_s: float = 600.0
    # > 0: scale to zero after this many times the model's reload time (node cache), within
    # [60 s, idle_to_zero_s] (`Autoscaler.idle_per_reload`, the platform's
    # `scale_to_zero_reload_factor`): a cheap reload is worth less keep-warm.
    idle_per_reload: float = 0.0


class SimRoute:
    """The gateway's counters of one endpoint, as `LoadTracker.observe` reads them."""

    __slots__ = ("outstanding", "requests_total", "waiting")

    def __init__(self) -> None:
        self.requests_total = 0
        self.outstanding = 0.0
        self.waiting = 0.0


@dataclass
class Placed:
    endpoint: int
    devices: list[int]
    ready_at: float
    pairs: list[int] = field(default_factory=list)
    occ: list[int] = field(default_factory=list)


class Fleet:
    def __init__(self, name: str, policy: Policy, service: Service, nodes: int) -> None:
        self.name, self.policy, self.s = name, policy, service
        n = len(service.tp)
        mem = service.device.memory_bytes
        pool = [
            d
            for i in range(nodes)
            for d in inventory(f"cuda:{DEVICES_PER_NODE}x{mem}", f"n{i:05d}")
        ]
        self.placement = Placement(pool)
        self.pos = {d: i for i, d in enumerate(self.placement.devices)}
        nd = len(pool)
        self.dev_n = np.zeros(nd, dtype=np.int64)
        self.dev_k = np.zeros(nd)
        self.dev_last_k = np.zeros(nd)
        self.dev_empty_since = np.full(nd, -math.inf)
        cap = 4 * nd + 16
        self.pair_ep = np.zeros(cap, dtype=np.int64)
        self.pair_dev = np.zeros(cap, dtype=np.int64)
        self.pair_on = np.zeros(cap, dtype=bool)
        self._free_pairs = list(range(cap - 1, -1, -1))
        # (endpoint, device) of every placed replica, any state: who holds what, per endpoint.
        self.occ_ep = np.zeros(cap, dtype=np.int64)
        self.occ_dev = np.zeros(cap, dtype=np.int64)
        self.occ_on = np.zeros(cap, dtype=bool)
        self._free_occ = list(range(cap - 1, -1, -1))
        self.replicas: list[list[Replica]] = [[] for _ in range(n)]
        self.placed: dict[str, Placed] = {}
        self.ready = np.zeros(n, dtype=np.int64)
        self.current = np.zeros(n, dtype=np.int64)  # starting + ready
        self.events: dict[int, list[tuple[str, str]]] = defaultdict(list)
        self.node_cache = [OrderedDict() for _ in range(nodes)]
        self.counters = Counters.for_delays(policy.release_delay_s, n)
        self.slow = np.ones(n)
        self.inflight = np.zeros(n)  # per endpoint, all replicas
        self.queue = np.zeros(n)
        self.queue_tokens = np.zeros(n)
        self.last_arrival = np.full(n, -math.inf)
        self.requests_total = np.zeros(n, dtype=np.int64)
        # First tick not observed; AWAKE when observed (ticks are negative in the warm-up).
        self.asleep_since = np.full(n, AWAKE, dtype=np.int64)
        self.wake_at = np.full(n, 1 << 62, dtype=np.int64)
        self.last_high = np.full(n, -(1 << 40), dtype=np.int64)  # last tick above target
        self.slept_busy = np.full(n, -(1 << 40), dtype=np.int64)  # last tick with traffic asleep
        # What `_observe` would have read at each of the last HISTORY ticks (row tick % HISTORY):
        # the requests so far and the requests in flight or queued (0 on a tick without traffic).
        self.hist_total = np.zeros((HISTORY, n), dtype=np.int64)
        self.hist_value = np.zeros((HISTORY, n))
        self.serial = 0
        self.now = 0.0
        self.cold_offsets: dict[int, np.ndarray] = {}
        mem_mult = np.where(policy.one_per_device, mem, service.mem_dev)
        self.mem_dev = np.asarray(mem_mult, dtype=np.int64)
        self._stable_s = ScalingPolicy().stable_window_s
        # Ticks a waking sleeper replays: its windows see no further back.
        self._replay = math.ceil(max(self._stable_s, policy.scale_down_delay_s) / TICK_S) + 1
        self.scalers: list[Autoscaler] = []
        self.trackers: list[LoadTracker] = []
        self.routes = [SimRoute() for _ in range(n)]
        self.target = np.array([policy.target * float(service.slots[e]) for e in range(n)])
        for e in range(n):
            target = float(self.target[e])
            self.scalers.append(Autoscaler(ScalingPolicy(
                metric="concurrency",
                target=target,
                min_replicas=1,
                max_replicas=policy.max_replicas,
                scale_to_zero=policy.scale_to_zero,
                idle_to_zero_s=policy.idle_to_zero_s,
                scale_down_delay_s=policy.scale_down_delay_s,
            )))  # fmt: skip
            self.trackers.append(LoadTracker("concurrency"))
            if policy.idle_per_reload > 0:  # as `scaling.Scaler` sets it: a measured reload
                self.scalers[-1].idle_per_reload = policy.idle_per_reload
                self.scalers[-1].reload_s = service.cold_start_s(e, True, policy.cold_scale)
        self.idle_limit = np.array([a.idle_limit() for a in self.scalers])
        assert self._replay < HISTORY

    # -- replicas -------------------------------------------------------------------------

    def scale_up(self, e: int, count: int, at: float, ready_now: bool = False) -> int:
        requests = []
        for _ in range(count):
            self.serial += 1
            requests.append(
                ReplicaRequest(f"r{self.serial}", str(e), int(self.mem_dev[e]), int(self.s.tp[e]))
            )
        result = self.placement.place(requests)
        self.counters.unschedulable += len(result.unschedulable)
        for rid, devices in result.assignments.items():
            positions = [self.pos[d] for d in devices]
            node = positions[0] // DEVICES_PER_NODE
            cache = self.node_cache[node]
            cached = e in cache
            if cached:
                cache.move_to_end(e)
                self.counters.cache_hits += 1
            else:
                cache[e] = float(self.s.weights[e])
                while sum(cache.values()) > NODE_CACHE_BYTES:
                    cache.popitem(last=False)
            cold = 0.0 if ready_now else self.s.cold_start_s(e, cached, self.policy.cold_scale)
            replica = Replica(rid, placement_id=rid, started_at=at)
            self.replicas[e].append(replica)
            info = Placed(e, positions, at + cold)
            self.placed[rid] = info
            for p in positions:
                self.dev_n[p] += 1
                self.dev_k[p] += self.s.capacity[e]
                slot = self._free_occ.pop()
                self.occ_ep[slot], self.occ_dev[slot], self.occ_on[slot] = e, p, True
                info.occ.append(slot)
            self.current[e] += 1
            self.counters.replica_starts += 1
            if ready_now:
                self._make_ready(rid)
            else:
                self.events[math.ceil((at + cold) / TICK_S - 1e-9)].append(("ready", rid))
        return len(result.assignments)

    def _make_ready(self, rid: str) -> None:
        info = self.placed[rid]
        replica = next(r for r in self.replicas[info.endpoint] if r.replica_id == rid)
        replica.state = ReplicaState.READY
        self.ready[info.endpoint] += 1
        for p in info.devices:
            slot = self._free_pairs.pop()
            self.pair_ep[slot], self.pair_dev[slot], self.pair_on[slot] = info.endpoint, p, True
            info.pairs.append(slot)

    def scale_down(self, e: int, count: int, tick: int) -> None:
        for replica in scale_down_order(self.replicas[e], self.placement)[:count]:
            self.replicas[e].remove(replica)
            self.current[e] -= 1
            info = self.placed[replica.replica_id]
            if replica.state is ReplicaState.READY:
                self.ready[e] -= 1
                for slot in info.pairs:
                    self.pair_on[slot] = False
                    self._free_pairs.append(slot)
                info.pairs.clear()
                replica.state = ReplicaState.DRAINING
                self.events[tick + 1].append(("free", replica.replica_id))
            else:
                self._free(replica.replica_id)

    def _free(self, rid: str) -> None:
        info = self.placed.pop(rid)
        self.placement.release(rid)
        for slot in info.occ:
            self.occ_on[slot] = False
            self._free_occ.append(slot)
        for p in info.devices:
            self.dev_n[p] -= 1
            self.dev_k[p] -= self.s.capacity[info.endpoint]
            if self.dev_n[p] == 0:
                self.dev_k[p] = 0.0
                self.dev_last_k[p] = self.s.capacity[info.endpoint]
                self.dev_empty_since[p] = self.now

    def begin_tick(self, tick: int) -> None:
        self.now = tick * TICK_S
        for kind, rid in self.events.pop(tick, ()):
            if rid not in self.placed:
                continue  # dropped while loading
            if kind == "ready":
                self._make_ready(rid)
            else:
                self._free(rid)

    def activate(self, tick: int, arrivals: np.ndarray, rng: np.random.Generator) -> None:
        """Requests for endpoints with no ready replica: draw their arrival times in the tick;
        an endpoint with no replica at all starts one at its first request (scale from zero)."""
        self.cold_offsets = {}
        for e in np.flatnonzero((arrivals > 0) & (self.ready == 0)).tolist():
            offsets = np.sort(rng.random(int(arrivals[e]))) * TICK_S
            self.cold_offsets[e] = offsets
            if self.current[e] == 0 and self.policy.autoscale:
                self.scale_up(e, 1, self.now + float(offsets[0]))

    def first_ready_at(self, e: int) -> float | None:
        """When the earliest of `e`'s loading replicas serves (None: none is loading)."""
        times = [
            self.placed[r.replica_id].ready_at
            for r in self.replicas[e]
            if r.state is ReplicaState.STARTING
        ]
        return min(times) if times else None

    # -- control --------------------------------------------------------------------------

    def control(self, tick: int, arrivals: np.ndarray) -> None:
        """The endpoint manager's tick, at the end of `tick`, for every endpoint with replicas.

        Quiet endpoints are put to sleep instead of being observed every tick: one replica,
        ready, and no observation in the autoscaler's windows above one replica's target. Each
        decision skipped while it sleeps would have kept the one replica: every average is at
        most the target, so the load asks for one replica and cannot start a panic, and the
        scale-down delay's recommendations it would add are 1s, which never hold a replica (a
        decision's own recommendation is at least 1); nothing else in `Autoscaler.decide`
        changes state the next decisions read. A sleeper wakes when an observation exceeds the
        target or when it would go to zero (its last request, kept here, sets when), and first
        replays from `hist_*` the observations its windows can still see (and marks its last
        request before them active), so its autoscaler decides on exactly the samples it
        would have had. This makes the cost follow the endpoints whose replica count can
        change, not all endpoints.
        """
        if not self.policy.autoscale:
            return
        self.requests_total += arrivals
        busy = (arrivals > 0) | (self.inflight > 0) | (self.queue > 0)
        # What `_observe` reads (the gateway counts what is in flight or queued on a tick with
        # traffic), and whether it is above one replica's target.
        value = np.where(busy, self.inflight + self.queue, 0.0)
        row = tick % HISTORY
        self.hist_total[row] = self.requests_total
        self.hist_value[row] = value
        high = value > self.target
        self.last_high[high] = tick
        current = self.current
        asleep = self.asleep_since != AWAKE
        # A sleeper with traffic: active, so its scale to zero moves (`_deadline`).
        moved = np.flatnonzero(asleep & busy)
        if len(moved):
            self.slept_busy[moved] = tick
            if self.policy.scale_to_zero:
                at = (tick + 1) * TICK_S + self.idle_limit[moved]
                self.wake_at[moved] = np.ceil(at / TICK_S - 1e-9).astype(np.int64) - 1
        awake = (current > 0) & (~asleep | high | (self.wake_at <= tick))
        idx = np.flatnonzero(awake)
        if not len(idx):
            return
        # Plain Python values of the awake endpoints, read once (numpy scalars are slow).
        ready_l = self.ready[idx].tolist()
        cur_l = current[idx].tolist()
        arr_l = arrivals[idx].tolist()
        since_l = self.asleep_since[idx].tolist()
        total_l = self.requests_total[idx].tolist()
        busy_l = busy[idx].tolist()
        value_l = value[idx].tolist()
        window = max(self._stable_s, self.policy.scale_down_delay_s)
        quiet_l = ((tick - self.last_high[idx]) * TICK_S > window + TICK_S).tolist()
        decisions = 0
        for j, e in enumerate(idx.tolist()):
            scaler = self.scalers[e]
            if ready_l[j] == 0:
                if arr_l[j] > 0:
                    scaler.mark_active((tick + 1) * TICK_S)
                continue  # nothing to judge until it serves
            since = since_l[j]
            if since != AWAKE:
                decisions += self._replay_sleep(e, since, tick)
            decisions += 1
            keep = cur_l[j] == 1 and ready_l[j] == 1 and quiet_l[j]
            if keep and busy_l[j]:
                # The observation is active (no scale to zero) and no sample in the windows is
                # above the target: the decision keeps the one replica (see above).
                self._observe(e, tick, total_l[j], value_l[j])
            elif self._decide(e, tick, total_l[j], value_l[j], cur_l[j]):
                continue
            if keep:
                self.asleep_since[e] = tick + 1
                self.slept_busy[e] = -(1 << 40)
                self.wake_at[e] = self._deadline(e)
        self.counters.decisions += decisions

    def _replay_sleep(self, e: int, since: int, tick: int) -> int:
        """Wake sleeper `e`: the observations of its skipped ticks that its windows can still
        see, after its last request before them. Returns how many it replayed."""
        start = max(since, tick - self._replay)
        busy = int(self.slept_busy[e])
        if since <= busy < start:
            self.scalers[e].mark_active((busy + 1) * TICK_S)
        if start > since:  # its tracker counts the requests since the tick before `start`
            route = self.routes[e]
            route.requests_total = int(self.hist_total[(start - 1) % HISTORY, e])
            route.outstanding = route.waiting = 0.0
            self.trackers[e].observe(start * TICK_S, route, {})  # type: ignore[arg-type]
        rows = [t % HISTORY for t in range(start, tick)]
        totals = self.hist_total[rows, e].tolist()
        values = self.hist_value[rows, e].tolist()
        for t, total, value in zip(range(start, tick), totals, values, strict=True):
            self._observe(e, t, total, value)
        self.asleep_since[e] = AWAKE
        return tick - start

    def _decide(self, e: int, tick: int, requests_total: int, busy: float, cur: int) -> bool:
        """Observe and decide for endpoint `e` at the end of `tick`; True if it scaled."""
        now = self._observe(e, tick, requests_total, busy)
        desired = self.scalers[e].decide(now, cur).desired
        if desired > cur:
            self.scale_up(e, desired - cur, now)
        elif desired < cur:
            self.scale_down(e, cur - desired, tick)
        return desired != cur

    def _observe(self, e: int, tick: int, requests_total: int, busy: float) -> float:
        """The gateway's counters of `e` at the end of `tick`, into its autoscaler's windows:
        `busy` is its requests in flight plus queued (the sum is all the metric reads)."""
        now = (tick + 1) * TICK_S
        route = self.routes[e]
        route.requests_total = requests_total
        route.outstanding = busy
        route.waiting = 0.0
        self.scalers[e].observe(self.trackers[e].observe(now, route, {}))  # type: ignore[arg-type]
        return now

    def _deadline(self, e: int) -> int:
        """The tick at whose end the endpoint has been idle long enough to go to zero."""
        if not self.policy.scale_to_zero:
            return 1 << 62
        last_active = self.scalers[e]._last_active
        if last_active is None:
            return 0
        idle = self.scalers[e].idle_limit()
        return math.ceil((last_active + idle) / TICK_S - 1e-9) - 1
