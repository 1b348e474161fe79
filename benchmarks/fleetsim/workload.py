"""From two one-hour traces to a fleet's traffic: endpoints, their rates and per-tick arrivals.

The documented transformation (every number here is a default of `WorkloadSpec`):

1. Endpoints: each serves one model of `service.CATALOGUE` (drawn by its share) and follows one
   trace, conversation (70 %) or code (30 %).
2. Popularity: endpoint i (in a random order) gets a share of the fleet's mean request rate
   `total_rps` (100/s) proportional to 1 / (rank + 3)^2 (a Zipf-Mandelbrot law, as model
   popularity is power-law distributed in multi-model serving studies): the top endpoints get
   10-35 requests/s, rank 10 about 2/s, rank 100 one every 20 s, rank 300 one every 5 minutes,
   rank 1,000 one an hour.
3. Envelope (stated, not from the traces, which span one hour): a daily cosine peaking at
   14:00 local time, peak/trough = (1 + `diurnal_amp`) / (1 - `diurnal_amp`), weekends at
   `weekend` of a weekday; endpoints' local time is UTC+0 (60 %), UTC-6 (25 %) or UTC+8 (15 %),
   jittered by N(0, 1.5 h). Day 0 is a Friday, so two days cover a weekday and a weekend day.
   Normalised so the week's mean is 1.
4. Burstiness: the endpoint's trace's own minute-scale rate (`trace.Trace.multiplier`),
   replayed cyclically from a random offset.
5. Arrivals: Poisson counts per 2 s tick at rate = share * total_rps * envelope * multiplier;
   each request's (context, generated) tokens are one request of its trace, drawn at random.

A seed fixes everything; every fleet variant of a seed sees exactly the same arrivals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fleetsim.service import CATALOGUE
from fleetsim.trace import KINDS, Trace

TICK_S = 2.0
DAY_S = 86400.0


@dataclass(frozen=True)
class WorkloadSpec:
    endpoints: int = 1000
    total_rps: float = 100.0  # fleet mean, over a week
    zipf_s: float = 2.0
    zipf_q: float = 3.0  # Zipf-Mandelbrot shift: the head is several large endpoints, not one
    code_share: float = 0.3
    diurnal_amp: float = 0.6
    weekend: float = 0.6


@dataclass
class Endpoints:
    model: np.ndarray  # index into CATALOGUE
    kind: np.ndarray  # index into trace.KINDS
    mean_rps: np.ndarray  # over a week
    phase_h: np.ndarray  # local time = UTC + phase
    offset: np.ndarray  # into the trace multiplier


def make_endpoints(spec: WorkloadSpec, rng: np.random.Generator) -> Endpoints:
    n = spec.endpoints
    shares = np.array([m.share for m in CATALOGUE])
    model = rng.choice(len(CATALOGUE), size=n, p=shares / shares.sum())
    kind = (rng.random(n) < spec.code_share).astype(np.int64)
    zipf = 1.0 / (np.arange(1, n + 1) + spec.zipf_q) ** spec.zipf_s
    mean_rps = spec.total_rps * rng.permutation(zipf / zipf.sum())
    zone = rng.choice([0.0, -6.0, 8.0], size=n, p=[0.6, 0.25, 0.15])
    phase = zone + rng.normal(0.0, 1.5, n)
    offset = rng.integers(0, 1 << 30, n)
    return Endpoints(model, kind, mean_rps, phase, offset)


def envelope(spec: WorkloadSpec, t_s: float | np.ndarray, phase_h: np.ndarray) -> np.ndarray:
    """Rate multiplier at UTC time `t_s` (0 = Friday 00:00) for endpoints at `phase_h`."""
    local = np.asarray(t_s) / 3600.0 + phase_h
    hour = np.mod(local, 24.0)
    day = np.floor_divide(local, 24.0).astype(np.int64) % 7  # 0 Friday, 1 Saturday, 2 Sunday
    daily = 1.0 + spec.diurnal_amp * np.cos(2 * np.pi * (hour - 14.0) / 24.0)
    week = np.where((day == 1) | (day == 2), spec.weekend, 1.0)
    return daily * week / ((5 + 2 * spec.weekend) / 7)


@dataclass
class Workload:
    spec: WorkloadSpec
    endpoints: Endpoints
    traces: dict[str, Trace]

    def __post_init__(self) -> None:
        tr = [self.traces[k] for k in KINDS]
        self._mult = [t.multiplier for t in tr]
        self.mean_prompt = np.array([tr[k].mean_prompt for k in self.endpoints.kind])
        self.mean_generated = np.array([tr[k].mean_generated for k in self.endpoints.kind])
        self._pairs = [(t.prompt, t.generated) for t in tr]

    def draw_prompts(self, e: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One trace prompt length for each endpoint in `e` (from its own trace)."""
        out = np.empty(len(e))
        kinds = self.endpoints.kind[e]
        for k, (p, _) in enumerate(self._pairs):
            sel = kinds == k
            if sel.any():
                out[sel] = p[rng.integers(0, len(p), int(sel.sum()))]
        return out

    def rates(self, tick: int) -> np.ndarray:
        """Expected requests/s of every endpoint during `tick`."""
        ep = self.endpoints
        env = envelope(self.spec, tick * TICK_S, ep.phase_h)
        mult = np.empty(len(ep.kind))
        for k, m in enumerate(self._mult):
            sel = ep.kind == k
            mult[sel] = m[(ep.offset[sel] + tick) % len(m)]
        return ep.mean_rps * env * mult

    def p99_rates(self, ticks: range, chunk: int = 100) -> np.ndarray:
        """Each endpoint's 99th percentile of its expected rate over `ticks`."""
        ep = self.endpoints
        t = np.asarray(ticks)
        out = np.zeros(len(ep.kind))
        for lo in range(0, len(ep.kind), chunk):
            sl = slice(lo, lo + chunk)
            env = envelope(self.spec, t[None, :] * TICK_S, ep.phase_h[sl, None])
            mult = np.empty_like(env)
            for i, e in enumerate(range(*sl.indices(len(ep.kind)))):
                m = self._mult[ep.kind[e]]
                mult[i] = m[(ep.offset[e] + t) % len(m)]
            out[sl] = np.percentile(ep.mean_rps[sl, None] * env * mult, 99, axis=1)
        return out


class Arrivals:
    """Per-tick arrivals and their tokens, from one seeded generator."""

    def __init__(self, workload: Workload, seed: int) -> None:
        self.w = workload
        self.rng = np.random.default_rng([seed, 7])
        self._kind = workload.endpoints.kind

    def tick(self, tick: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(requests, context tokens, generated tokens) per endpoint in `tick`."""
        counts = self.rng.poisson(self.w.rates(tick) * TICK_S)
        n = len(counts)
        prompt = np.zeros(n)
        gen = np.zeros(n)
        who = np.flatnonzero(counts)
        if len(who):
            for k, (p, g) in enumerate(self.w._pairs):
                sel = who[self._kind[who] == k]
                if not len(sel):
                    continue
                each = np.repeat(sel, counts[sel])
                idx = self.rng.integers(0, len(p), len(each))
                prompt += np.bincount(each, weights=p[idx], minlength=n)
                gen += np.bincount(each, weights=g[idx], minlength=n)
        return counts, prompt, gen
