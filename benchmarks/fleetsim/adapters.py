"""Shared bases: fine-tuned endpoints served as LoRA adapters on autoscaled replicas of their base.

The workload mix (stated assumption): a share of the endpoints (swept 0 / 50 / 80 / 100 %) are
rank-8 LoRA fine-tunes of the public base their endpoint already serves in the catalogue
(Qwen2.5 0.5B-32B, Llama 3.2 3B, Llama 3.1 8B/70B, `service.CATALOGUE`); the rest keep their own
full weights. Which endpoints are adapters is drawn once per seed from its own generator (one
uniform number each; the share is a threshold, so the 50 % set is inside the 80 % set). The
source of the assumption: these bases are among the most fine-tuned on the Hugging Face Hub
(their model trees list thousands of adapters and fine-tunes each), and a multi-tenant
platform's answer for "100 customers each fine-tuned Llama" is one base + 100 adapters (the
platform's spec; S-LoRA, Sheng et al. 2023, and Punica, Chen et al. 2023, serve that mix).

Serving (`AdapterMix`): the adapters of one base become one *unit*, a single autoscaled endpoint
of that base whose arrivals are the sum of its members' (same arrivals as the fleet without
adapters, aggregated); every other endpoint is a unit of its own. A shared-base replica:

- runs every step at `MIXED_THROUGHPUT` of the base's speed (the engine's own measurement, 50
  mixed rank-8 adapters on all projections: 0.632 of base throughput, issue 24's re-run of
  `benchmarks/lora.py --rounds 3` on a quiet AMD EPYC AVX-512; BENCHMARKS' earlier 0.79-0.82 was
  against a slower base). Its token capacity stays the base's, so the adapters' cost shows as
  lower token-slot utilization, not higher capacity.
- holds `ADAPTER_SLOTS` adapters (the engine's `max_loras`, LRU) in extra device memory
  (`ADAPTER_PARAM_SHARE` of the base's parameters each: rank 8 on all 7 projections of
  Llama-3.1-8B is 21 M parameters, 0.26 %).

`Residency`: an adapter is loaded on its base while it is among the `ready replicas x slots`
most recently used adapters of that base and was used since the base's replicas last came up
from zero. A request whose adapter is not loaded, on a base with a ready replica, is an
*adapter-cold* request: its TTFT adds the load time, `adapter_load_s` = the engine's measured
fixed cost + bytes / node-cache bandwidth (`measure_adapter_load.py`). A request that finds no
ready base replica is cold as before (the replica start dwarfs the adapter load).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from fleetsim.service import CACHE_BW, CATALOGUE, Service, build_service
from fleetsim.workload import Workload

MIXED_THROUGHPUT = 0.632  # of the base's throughput, 50 mixed rank-8 adapters (issue 24)
ADAPTER_SLOTS = 64  # per replica (`max_loras`)
ADAPTER_PARAM_SHARE = 0.0026  # rank 8, all projections, of the base's parameters
MEASURED_LOAD = Path(__file__).with_name("adapter_load_epyc-2vcpu.json")


def load_cost(path: Path = MEASURED_LOAD) -> tuple[float, float, str]:
    """(fixed seconds per load, bytes/s of the engine's own load path, source)."""
    if not path.exists():
        return 0.05, 1.0e9, "default (no measured table)"
    m = json.loads(path.read_text())
    # The engine's load is bytes / its rate; on a GPU node the copy is bounded by the node cache.
    return 0.0, float(m["bytes_per_s_median"]), path.name


def adapter_load_s(params: float) -> float:
    """Seconds to load a rank-8 adapter of a base with `params` parameters."""
    fixed, rate, _ = load_cost()
    size = 2.0 * ADAPTER_PARAM_SHARE * params  # bf16
    return fixed + size / min(rate, CACHE_BW)


@dataclass
class AdapterMix:
    """Endpoints -> units (shared bases and endpoints of their own), and the units' service."""

    share: float
    unit_of: np.ndarray  # endpoint -> unit
    is_adapter: np.ndarray  # per endpoint
    pooled: np.ndarray  # per unit: a shared base
    unit_model: np.ndarray  # per unit: catalogue index
    code_frac: np.ndarray  # per unit: share of its rate on the code trace
    service: Service
    load_s: np.ndarray  # per unit: an adapter's load time (0 for own endpoints)

    @property
    def units(self) -> int:
        return len(self.pooled)

    def aggregate(self, x: np.ndarray) -> np.ndarray:
        """Per-endpoint values summed per unit (identity when nothing is pooled)."""
        if not self.pooled.any():
            return x
        out = np.bincount(self.unit_of, weights=x, minlength=self.units)
        return out.astype(x.dtype) if x.dtype.kind == "i" else out


def build_mix(workload: Workload, endpoint_service: Service, share: float, seed: int) -> AdapterMix:
    ep = workload.endpoints
    n = len(ep.model)
    u = np.random.default_rng([seed, 31]).random(n)
    is_adapter = u < share
    own = np.flatnonzero(~is_adapter)
    bases = np.unique(ep.model[is_adapter])
    unit_of = np.empty(n, dtype=np.int64)
    unit_of[own] = np.arange(len(own))
    base_unit = {int(m): len(own) + i for i, m in enumerate(bases.tolist())}
    for e in np.flatnonzero(is_adapter).tolist():
        unit_of[e] = base_unit[int(ep.model[e])]
    units = len(own) + len(bases)
    pooled = np.zeros(units, dtype=bool)
    pooled[len(own) :] = True
    unit_model = np.concatenate([ep.model[own], bases]).astype(np.int64)
    if not pooled.any():
        return AdapterMix(
            share, unit_of, is_adapter, pooled, unit_model, ep.kind.astype(float),
            endpoint_service, np.zeros(units),
        )  # fmt: skip
    w = ep.mean_rps
    weight = np.bincount(unit_of, weights=w, minlength=units)

    def agg(x: np.ndarray) -> np.ndarray:  # rate-weighted mean over each unit's endpoints
        return np.bincount(unit_of, weights=w * x, minlength=units) / weight

    mean_prompt, mean_gen = agg(workload.mean_prompt), agg(workload.mean_generated)
    code_frac = agg(ep.kind.astype(float))
    s = build_service(
        unit_model, mean_prompt, mean_gen, endpoint_service.device, endpoint_service.host
    )
    slow = np.where(pooled, 1.0 / MIXED_THROUGHPUT, 1.0)
    params = np.array([CATALOGUE[m].params for m in unit_model])
    extra = np.where(pooled, ADAPTER_SLOTS * 2.0 * ADAPTER_PARAM_SHARE * params / s.tp, 0.0)
    s = replace(
        s,
        c0=s.c0 * slow,
        c1=s.c1 * slow,
        pf0=s.pf0 * slow,
        pf1=s.pf1 * slow,
        dev_s_full=s.dev_s_full * slow,  # capacity stays the base's: the cost shows as usage
        mem_dev=(s.mem_dev + extra).astype(np.int64),
    )
    load = np.where(pooled, [adapter_load_s(p) for p in params], 0.0)
    return AdapterMix(share, unit_of, is_adapter, pooled, unit_model, code_frac, s, load)


class UnitWorkload:
    """`serving.serve`'s view of the workload (prompt lengths) for units instead of endpoints."""

    def __init__(self, workload: Workload, mix: AdapterMix) -> None:
        self.w, self.mix = workload, mix
        first = np.full(mix.units, -1, dtype=np.int64)
        own = ~mix.is_adapter
        first[mix.unit_of[own]] = np.flatnonzero(own)
        self.endpoint = first  # a unit of its own -> its endpoint
        codes = np.flatnonzero(workload.endpoints.kind == 1)
        convs = np.flatnonzero(workload.endpoints.kind == 0)
        self.rep = (int(convs[0]) if len(convs) else 0, int(codes[0]) if len(codes) else 0)

    def draw_prompts(self, units: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        units = np.asarray(units)
        pooled = self.mix.pooled[units]
        if not pooled.any():
            return self.w.draw_prompts(self.endpoint[units], rng)
        code = rng.random(len(units)) < self.mix.code_frac[units]
        e = np.where(pooled, np.where(code, self.rep[1], self.rep[0]), self.endpoint[units])
        return self.w.draw_prompts(e, rng)


class Residency:
    """Which adapters are loaded on their base (LRU over the base's ready replicas' slots)."""

    def __init__(self, mix: AdapterMix) -> None:
        self.mix = mix
        self.idx = np.flatnonzero(mix.is_adapter)  # adapter endpoints
        self.unit = mix.unit_of[self.idx]
        self.last = np.full(len(self.idx), -np.inf)
        self.ready_since = np.full(mix.units, np.inf)
        self.prev_ready = np.zeros(mix.units, dtype=np.int64)
        self.loads = 0.0

    def cold(self, now: float, arrivals: np.ndarray, ready: np.ndarray) -> np.ndarray:
        """Per adapter endpoint: requests this tick whose adapter must be loaded first (on a
        base with a ready replica); then marks this tick's requests as the most recent use."""
        came_up = (ready > 0) & (self.prev_ready == 0)
        self.ready_since[came_up] = now
        self.ready_since[ready == 0] = np.inf
        self.prev_ready = ready.copy()
        a = arrivals[self.idx]
        out = np.zeros(len(self.idx))
        hit = (a > 0) & (ready[self.unit] > 0)
        if hit.any():
            # Rank by recency within the base (0 = most recent), ties by position.
            order = np.lexsort((-self.last, self.unit))
            rank = np.empty(len(order), dtype=np.int64)
            start = np.searchsorted(self.unit[order], self.unit[order], side="left")
            rank[order] = np.arange(len(order)) - start
            slots = ready[self.unit] * ADAPTER_SLOTS
            loaded = (self.last >= self.ready_since[self.unit]) & (rank < slots)
            cold = hit & ~loaded
            out[cold] = a[cold]
            self.loads += float(cold.sum())
        self.last[a > 0] = now
        return out
