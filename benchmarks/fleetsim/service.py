"""The service model: measured engine costs, scaled to GPU devices by a roofline; cold starts.

Host cost (measured): `measure_engine.py` times the real engine on this machine with a tiny
model, whose device work is negligible, so its decode step time is the engine's host cost:
`host_step_s + host_per_seq_s * batch` (Python scheduling, input preparation, sampling). A GPU
host pays it too. The fit is read from `step_time_<machine>.json` beside this file.

Device cost (roofline, stated): a decode step streams the weights and the batch's KV cache
through memory, a prefill is compute-bound:
    decode step(B) = host_step + host_per_seq*B + (W + B*ctx*kv_per_token) / (BW_EFF * BW)
    prefill(P)     = host_step + max(2*N*P / (FLOP_EFF * FLOPS), W / (BW_EFF * BW))
per device of a replica (W, N, kv divided by its tensor-parallel degree), with ctx the trace's
mean prompt plus half its mean output. Engines sharing a device share it by time-slicing (no
MPS): a device whose engines ask for more than one device-second per second slows them all
by that factor (`serving`).

Replica sizing: weights + KV budget + 512 MiB per device; a replica runs on the fewest devices
(1, 2, 4, 8) that hold its weights and 32 slots. One slot is `SLOT_TOKENS` of KV (the platform's
`admission_tokens_per_request`, set to the traces' mean prompt + output); C = KV / slot. A
replica on one device keeps 32 slots; a multi-device one fills its devices (90 %).

Cold start (bytes moved at each layer's bandwidth, stated): a replica's weights come from the
node's cache (local NVMe, `CACHE_BW`) or, on a miss, first from the artifact store over the
node's network (`STORE_BW`), plus `START_S` to start the worker and its CUDA context. The
platform's warm pool (an idle loaded replica taken over in ~0.3 s, BENCHMARKS "Cold start")
holds base models only; tenants' endpoints here are their own weights, so it is not used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modelyard.control.placement import DEFAULT_OVERHEAD_BYTES, GiB

BW_EFF = 0.8  # achieved share of peak memory bandwidth in decode
FLOP_EFF = 0.5  # achieved share of peak bf16 FLOPs in prefill
SLOT_TOKENS = 2048
SLOTS_PER_REPLICA = 32
STORE_BW = 2.5e9  # artifact store -> node, bytes/s (a 25 Gbit/s NIC, object storage)
CACHE_BW = 6.0e9  # node cache (NVMe) -> device, bytes/s
START_S = 5.0  # worker process, CUDA context, warm-up step
DEVICES_PER_NODE = 8
NODE_CACHE_BYTES = 2048 * GiB
MEASURED = Path(__file__).with_name("step_time_epyc-zen4-2vcpu.json")


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s, peak
    flops: float  # bf16 dense, peak


DEVICES = {
    "h100": DeviceSpec("H100 SXM 80GB", 80 * GiB, 3.35e12, 989e12),
    "a100": DeviceSpec("A100 SXM 80GB", 80 * GiB, 2.039e12, 312e12),
    "l4": DeviceSpec("L4 24GB", 24 * GiB, 300e9, 121e12),
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    share: float  # of endpoints

    @property
    def weights_bytes(self) -> float:
        return 2.0 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


CATALOGUE = (
    ModelSpec("0.5B (Qwen2.5-0.5B)", 0.49e9, 24, 2, 64, 0.10),
    ModelSpec("1.5B (Qwen2.5-1.5B)", 1.54e9, 28, 2, 128, 0.15),
    ModelSpec("3B (Llama-3.2-3B)", 3.21e9, 28, 8, 128, 0.20),
    ModelSpec("8B (Llama-3.1-8B)", 8.03e9, 32, 8, 128, 0.30),
    ModelSpec("14B (Qwen2.5-14B)", 14.7e9, 48, 8, 128, 0.12),
    ModelSpec("32B (Qwen2.5-32B)", 32.8e9, 64, 8, 128, 0.08),
    ModelSpec("70B (Llama-3.1-70B)", 70.6e9, 80, 8, 128, 0.05),
)


@dataclass(frozen=True)
class HostCost:
    step_s: float
    per_seq_s: float
    source: str


def host_cost(path: Path = MEASURED) -> HostCost:
    """The tiny model's fit from the measured table (default if the file is missing)."""
    if not path.exists():
        return HostCost(1.0e-3, 30e-6, "default (no measured table)")
    fit = json.loads(path.read_text())["models"]["tiny"]["fit"]
    return HostCost(max(fit["step_s"], 0.0), max(fit["per_seq_s"], 0.0), path.name)


def tensor_parallel(model: ModelSpec, device: DeviceSpec) -> int:
    for tp in (1, 2, 4, 8):
        need = (
            model.weights_bytes / tp
            + DEFAULT_OVERHEAD_BYTES
            + SLOTS_PER_REPLICA * SLOT_TOKENS * model.kv_bytes_per_token / tp
        )
        if need <= 0.9 * device.memory_bytes:
            return tp
    raise ValueError(f"{model.name} does not fit 8 x {device.name}")


@dataclass
class Service:
    """Per endpoint (arrays): sizing and the step-time coefficients of its replicas."""

    tp: np.ndarray  # devices per replica
    mem_dev: np.ndarray  # bytes per device
    weights: np.ndarray  # bytes, whole model
    slots: np.ndarray  # C
    c0: np.ndarray  # decode step = c0 + c1 * B (s), per device of the replica
    c1: np.ndarray
    pf0: np.ndarray  # prefill(P) = pf0 + pf1 * P (s), at least the weight read
    pf1: np.ndarray
    mean_prompt: np.ndarray
    mean_generated: np.ndarray
    dev_s_full: np.ndarray  # device-seconds per request when every slot is in use
    capacity: np.ndarray  # tokens/s of a replica with every slot in use (time-sliced device)
    host: HostCost
    device: DeviceSpec

    def prefill_s(self, e: np.ndarray, prompt: np.ndarray) -> np.ndarray:
        return self.pf0[e] + self.pf1[e] * prompt

    def step_s(self, e: np.ndarray, batch: np.ndarray) -> np.ndarray:
        return self.c0[e] + self.c1[e] * np.maximum(batch, 1.0)

    def cold_start_s(self, e: int, cached: bool, scale: float) -> float:
        w = float(self.weights[e])
        return scale * (START_S + w / CACHE_BW + (0.0 if cached else w / STORE_BW))


def build_service(
    model_idx: np.ndarray,
    mean_prompt: np.ndarray,
    mean_generated: np.ndarray,
    device: DeviceSpec,
    host: HostCost,
) -> Service:
    n = len(model_idx)
    bw, fl = BW_EFF * device.bandwidth, FLOP_EFF * device.flops
    arr = {k: np.zeros(n) for k in ("tp", "mem", "w", "slots", "c0", "c1", "pf0", "pf1")}
    ctx = mean_prompt + mean_generated / 2
    for e in range(n):
        m = CATALOGUE[model_idx[e]]
        tp = tensor_parallel(m, device)
        w_dev = m.weights_bytes / tp
        kv_tok_dev = m.kv_bytes_per_token / tp
        if tp == 1:
            kv_dev = SLOTS_PER_REPLICA * SLOT_TOKENS * kv_tok_dev
        else:
            kv_dev = 0.9 * device.memory_bytes - w_dev - DEFAULT_OVERHEAD_BYTES
        slots = max(1, int(kv_dev // (SLOT_TOKENS * kv_tok_dev)))
        arr["tp"][e], arr["w"][e], arr["slots"][e] = tp, m.weights_bytes, slots
        arr["mem"][e] = int(w_dev + kv_dev + DEFAULT_OVERHEAD_BYTES)
        arr["c0"][e] = host.step_s + w_dev / bw
        arr["c1"][e] = host.per_seq_s + ctx[e] * kv_tok_dev / bw
        arr["pf0"][e] = host.step_s
        arr["pf1"][e] = 2 * m.params / tp / fl
        # Prefill reads the weights at least once: a short prompt is bandwidth-bound.
        arr["pf0"][e] += max(0.0, w_dev / bw - arr["pf1"][e] * mean_prompt[e])
    slots = arr["slots"]
    prefill = arr["pf0"] + arr["pf1"] * mean_prompt
    dev_s_full = prefill + mean_generated * (arr["c0"] + arr["c1"] * slots) / slots
    return Service(
        tp=arr["tp"].astype(np.int64),
        mem_dev=arr["mem"].astype(np.int64),
        weights=arr["w"],
        slots=slots.astype(np.int64),
        c0=arr["c0"],
        c1=arr["c1"],
        pf0=arr["pf0"],
        pf1=arr["pf1"],
        mean_prompt=mean_prompt,
        mean_generated=mean_generated,
        dev_s_full=dev_s_full,
        capacity=(mean_prompt + mean_generated) / dev_s_full,
        host=host,
        device=device,
    )
