"""Trace-driven fleet simulator: the platform's own autoscaler, load tracker and placement on a
simulated GPU fleet, with utilization counted as tokens processed over token capacity.

Modules, one job each: `trace` (the Azure LLM traces), `workload` (traces -> per-endpoint
arrivals), `service` (measured engine costs scaled to GPUs by a roofline, cold starts),
`fleet` (replicas, devices, the control loop), `serving` (the per-tick fluid serving step),
`metrics` (accounting), `variants` (the fleets compared), `runner` (seeds and variants in
lockstep), `report` (confidence intervals, tables). `benchmarks/fleet_sim.py` is the command.
The levers (`benchmarks/fleet_levers.py`): `adapters` (fine-tunes as adapters on shared base
replicas), `batch` (batch demand, backfill, batch replicas), `levers` (a seed's levered fleets
in lockstep), `levers_report` (elastic and spot pricing, tables).
"""
