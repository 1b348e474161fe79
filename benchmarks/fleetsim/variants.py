"""The fleets compared in one run, all on the same arrivals.

- `autoscaled`: the platform as configured by default (per-endpoint autoscaler on requests in
  flight at 70 % of a replica's slots, scale to zero after 300 s idle, replicas packed onto
  shared devices by `Placement`).
- `static-p99`: no autoscaler; each endpoint keeps, always on, the replicas its 99th
  percentile rate over the run needs at 70 % of their full-slot throughput (at least one).
- `one-per-device`: the same autoscaler, every replica on devices of its own (what packing adds).
- `no-scale-to-zero`: the same autoscaler with `scale_to_zero` off: one replica per endpoint
  always on (what scaling to zero costs in cold starts, and saves in devices).
- sensitivity: `cold-x3` (every cold start 3x longer). The release delay of an emptied device
  (default 600 s) changes no decision, only what is provisioned, so every run accounts for
  0 s, 600 s and 3600 s at once (`metrics.DELAYS`).
- A/B of a control-plane change: `ab-<name>`, the autoscaled fleet with only that change;
  `ab-reload-idle`: scale to zero after 10x the model's reload time (60 s to 300 s) instead of
  300 s for every model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fleetsim.fleet import Policy


@dataclass(frozen=True)
class Variant:
    name: str
    policy: Policy
    static: bool = False  # replicas sized to p99 demand, placed once
    warm_start: bool = False  # one ready replica per endpoint at the start


BASE = Policy()


def catalogue(base: Policy = BASE, ab: dict[str, Policy] | None = None) -> dict[str, Variant]:
    out = {
        "autoscaled": Variant("autoscaled", base),
        "static-p99": Variant("static-p99", replace(base, autoscale=False), static=True),
        "one-per-device": Variant("one-per-device", replace(base, one_per_device=True)),
        "no-scale-to-zero": Variant(
            "no-scale-to-zero", replace(base, scale_to_zero=False), warm_start=True
        ),
        "cold-x3": Variant("cold-x3", replace(base, cold_scale=3.0)),
    }
    out["ab-reload-idle"] = Variant("ab-reload-idle", replace(base, idle_per_reload=10.0))
    for name, policy in (ab or {}).items():
        out[f"ab-{name}"] = Variant(f"ab-{name}", policy)
    return out


MAIN = ("autoscaled", "static-p99", "one-per-device", "no-scale-to-zero")
SENSITIVITY = ("cold-x3",)
AB = ("ab-reload-idle",)
