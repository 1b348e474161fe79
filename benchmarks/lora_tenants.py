"""Tenants' fine-tunes as adapters on one base worker, against one merged-model worker each.

Issue 24 item 5 on the real engine. `--tenants` random PEFT adapters (rank `--rank` on every
projection, as `benchmarks/lora.py` writes them) of SmolLM2-135M, served two ways on this
machine, one after the other:

- shared: ONE worker serving the base with every adapter (`max_loras` = the tenant count, the
  adapters read from its `lora_dir`); tenant i calls `<base>:adapter{i}`;
- merged: one worker per tenant, each serving the base with that tenant's adapter merged into
  its weights (W + scale * B @ A, written as its own model folder); `--merged` of them (fewer
  than the tenants when that many fp32 SmolLM2 processes do not fit the memory: the per-tenant
  memory is measured on these and the rest extrapolated, as the table says).

Each tenant sends `--requests` streamed completions, one after another (`--prompt-len` random
token prompt, exactly `--max-tokens` tokens, EOS ignored), all tenants at once, straight to the
worker's OpenAI API (the gateway's share is measured in `benchmarks/gateway_overhead.py`).
Reported per setup: output tokens/s over the whole load, TTFT p50/p99 (first streamed token),
and memory per tenant: the workers' proportional set size (PSS: shared libraries counted once
across the processes) summed and divided by the tenants served.

`--through-gateway`: the same two setups as a user of the platform gets them, through
`modelyard serve` (SQLite, memory store): `--tenants` tenants, each with its own API key,
each pushing its adapter (as `tuned`) to the registry against the public `smollm2` that serve
deploys (one replica, `bundled_max_loras` = the tenant count, float32), and calling `tuned`
with its own key through the gateway; then `--merged` of them each deploy their merged model
(as `merged`, one replica each) and call it the same way. Memory: the replicas' PSS (serve's
own process and the bundled embedding model's replica not counted).

A stream's error event, a failed request or a process that exits fails the run, printing every
process's log (the worker's or serve's with its replicas).

    python benchmarks/lora_tenants.py --tenants 5
    python benchmarks/lora_tenants.py --tenants 50 --merged 5 --requests 2
    python benchmarks/lora_tenants.py --tenants 50 --merged 5 --requests 2 --through-gateway
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lora import MODULES, write_adapter
from modelyard.config import EngineSettings
from modelyard.engine.lora.adapter import projection_shapes
from modelyard.engine.models.loader import read_model_config, to_hf_folder
from modelyard.registry_client import RegistryClient
from tests.platform_harness import PlatformProcess, create_key, create_tenant, deploy, wait_status

ROOT = Path(__file__).resolve().parent.parent


class Target(NamedTuple):
    """Where one tenant sends its requests: a base URL, the model name, its API key (if any)."""

    url: str
    model: str
    key: str | None = None


Row = tuple[str, int, int, dict[str, Any]]  # label, tenants, workers, result


def merge(base: Path, adapter: Path, out: Path, rank: int) -> None:
    """`base`'s folder with `adapter` merged into its weights (scale = lora_alpha / r = 2, as
    `write_adapter` writes it)."""
    weights = load_file(str(base / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    scale = 2.0  # write_adapter: lora_alpha = 2 * rank
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        weights[name] = weights[name] + scale * (b.float() @ a.float()).to(weights[name].dtype)
    out.mkdir(parents=True)
    for item in base.iterdir():
        if item.name != "model.safetensors":
            (out / item.name).symlink_to(item)
    save_file(weights, str(out / "model.safetensors"))


def pss_bytes(pid: int) -> int:
    """The process's proportional set size (shared pages split among their users)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


class Worker:
    def __init__(self, model: Path, name: str, env: dict[str, str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "modelyard.cli", "worker", "--model", str(model)]
        cmd += ["--port", str(port), "--log-level", "warning", "--served-model-name", name]
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the worker
        self.proc = subprocess.Popen(
            cmd, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                sys.exit(f"worker exited with {self.proc.returncode}:\n{self.log.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        sys.exit("worker did not become healthy")

    def output(self) -> str:
        """Everything the worker wrote so far (stdout and stderr)."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def tenant_load(
    target: Target, prompts: list[list[int]], max_tokens: int, ttfts: list[float]
) -> int:
    """One tenant's requests in turn; returns the tokens it got, appends its TTFTs."""
    tokens = 0
    headers = {"authorization": f"Bearer {target.key}"} if target.key else {}
    with httpx.Client(timeout=3600.0, headers=headers) as client:
        for prompt in prompts:
            body = {"model": target.model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            started, first = time.perf_counter(), None
            with client.stream("POST", f"{target.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{target.model}: HTTP {r.status_code}: {r.read()!r}")
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:  # the stream's error event
                        raise RuntimeError(f"{target.model}: {chunk['error']}")
                    if first is None and chunk.get("choices"):  # a token (its text may be
                        # empty: a random prompt's first token can be part of a character)
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
            if first is None:
                raise RuntimeError(f"{target.model}: the stream ended without a token")
            ttfts.append(first - started)
    return tokens


def drive(targets: list[Target], prompts: list[list[int]], max_tokens: int) -> dict:
    """Every tenant's load at once; raises the first tenant's failure (how many failed)."""
    ttfts: list[float] = []
    counts = [0] * len(targets)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            counts[i] = tenant_load(targets[i], prompts, max_tokens, ttfts)
        except BaseException as exc:  # reported by the main thread, not lost in this one
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(targets))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    if errors:
        raise RuntimeError(
            f"{len(errors)} of {len(targets)} tenants failed; the first: {errors[0]}"
        ) from errors[0]
    ttfts.sort()
    return {
        "tokens": sum(counts),
        "seconds": seconds,
        "tok_s": sum(counts) / seconds,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    }


def measure(label: str, targets: list[Target], prompts: list[list[int]], max_tokens: int,
            pids: list[int], workers: int) -> Row:  # fmt: skip
    """A warm-up request per tenant (every adapter into its slot), then the measured load."""
    warm = drive(targets, prompts[:1], 2)
    print(f"{label}: warm-up {warm}", flush=True)
    result = drive(targets, prompts, max_tokens)
    result["pss"] = sum(pss_bytes(pid) for pid in pids)
    print(f"{label}: {result}", flush=True)
    return label, len(targets), workers, result


def direct(
    args: argparse.Namespace, folder: Path, tmp: Path, prompts: list[list[int]]
) -> list[Row]:
    """Both setups as bare `modelyard worker` processes, requests straight to them."""
    common = {"MODELYARD_DTYPE": "float32", "MODELYARD_KV_CACHE_MEMORY": args.kv_cache,
              "MODELYARD_MAX_NUM_SEQS": str(max(16, args.tenants))}  # fmt: skip
    env = {
        **common,
        "MODELYARD_MAX_LORAS": str(args.tenants),
        "MODELYARD_MAX_LORA_RANK": str(args.rank),
        "MODELYARD_LORA_DIR": str(tmp / "adapters"),
    }
    rows = []
    workers = [Worker(folder, "base", env, args.port)]
    try:
        workers[0].wait_ready()
        targets = [Target(workers[0].url, f"base:adapter{i}") for i in range(args.tenants)]
        label = "shared: 1 worker, base + adapters"
        rows.append(measure(label, targets, prompts, args.max_tokens, [workers[0].proc.pid], 1))
        workers.pop().stop()
        if not args.skip_merged:
            for i in range(args.merged):
                out = tmp / f"merged{i}"
                merge(folder, tmp / "adapters" / f"adapter{i}", out, args.rank)
                workers.append(Worker(out, "merged", common, args.port + 1 + i))
            for w in workers:
                w.wait_ready()
            targets = [Target(w.url, "merged") for w in workers]
            pids = [w.proc.pid for w in workers]
            label = "merged: 1 worker per tenant"
            rows.append(measure(label, targets, prompts, args.max_tokens, pids, len(workers)))
    except BaseException:
        for w in workers:
            w.stop()
            print(f"--- {w.url}'s log ---\n{w.output()}", file=sys.stderr)
        raise
    finally:
        for w in workers:
            w.stop()
    return rows


def replica_pids(api: httpx.Client, endpoint_id: str) -> list[int]:
    items = api.get(f"/v1/endpoints/{endpoint_id}").json()["replicas"]["items"]
    return [int(r["pid"]) for r in items if r.get("pid")]


def through_gateway(
    args: argparse.Namespace, folder: Path, tmp: Path, prompts: list[list[int]]
) -> list[Row]:
    """Both setups deployed on `modelyard serve`, each tenant calling its own model with its own
    key through the gateway."""
    engine = {"kv_cache_memory": args.kv_cache, "dtype": "float32", "quantization": "none",
              "max_num_seqs": max(16, args.tenants), "max_lora_rank": args.rank}  # fmt: skip
    env = {
        "MODELYARD_WORKER_ENGINE": json.dumps(engine),
        "MODELYARD_BUNDLED_MAX_LORAS": str(args.tenants),  # the public smollm2's slots
        "MODELYARD_LOCAL_ARTIFACT_ROOTS": json.dumps([str(tmp)]),  # the merged models
        "MODELYARD_REPLICA_START_TIMEOUT_S": "1800",  # a loaded 2 vCPU starts replicas slowly
        # The gateway admits KV capacity / this many requests per replica: the workload's own
        # need (prompt + output), as an operator sets it; the default (1024) admits one
        # request at a time into a 64 MiB cache, and the other tenants' wait ends in 429s.
        "MODELYARD_ADMISSION_TOKENS_PER_REQUEST": str(args.prompt_len + args.max_tokens),
        "PYTHONPATH": str(ROOT / "src"),
    }
    serve = PlatformProcess(tmp / "data", env, default_models=True)
    rows = []
    try:
        serve.start(timeout=1800)
        admin = serve.api()
        base = next(e["endpoint_id"] for e in admin.get("/v1/endpoints").json()["data"]
                    if e["model_name"] == args.model)  # fmt: skip
        keys = []
        for i in range(args.tenants):
            tenant = create_tenant(admin, f"tenant{i}")
            key = create_key(admin, tenant, scopes=["admin", "inference"], rpm_limit=10**6,
                             tpm_limit=10**9)["key"]  # fmt: skip
            with contextlib.redirect_stdout(io.StringIO()):  # its progress bars
                RegistryClient(serve.url, key).push(tmp / "adapters" / f"adapter{i}", "tuned",
                                                    base=args.model)  # fmt: skip
            keys.append(key)
        print(f"{args.tenants} tenants pushed their adapters against {args.model}", flush=True)
        targets = [Target(serve.url, "tuned", key) for key in keys]
        label = "shared, gateway: 1 replica, base + adapters"
        pids = replica_pids(admin, base)
        rows.append(measure(label, targets, prompts, args.max_tokens, pids, len(pids)))
        if not args.skip_merged:
            endpoints = []
            for i in range(args.merged):
                out = tmp / f"merged{i}"
                merge(folder, tmp / "adapters" / f"adapter{i}", out, args.rank)
                endpoints.append(deploy(serve.api(keys[i]), "merged", str(out), wait=False))
            for endpoint in endpoints:
                wait_status(admin, endpoint, "ready", timeout=1800)
            print(f"{args.merged} merged endpoints ready", flush=True)
            targets = [Target(serve.url, "merged", keys[i]) for i in range(args.merged)]
            pids = [pid for e in endpoints for pid in replica_pids(admin, e)]
            label = "merged, gateway: 1 replica per tenant"
            rows.append(measure(label, targets, prompts, args.max_tokens, pids, len(pids)))
    except BaseException:
        serve.stop()
        print(f"--- modelyard serve's log (with its replicas) ---\n{serve.output()}",
              file=sys.stderr)  # fmt: skip
        raise
    finally:
        serve.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tenants", type=int, default=5)
    ap.add_argument("--merged", type=int, default=None, help="merged workers (default: tenants)")
    ap.add_argument("--requests", type=int, default=4, help="per tenant")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache", default="64MiB", help="each worker's KV cache")
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--skip-merged", action="store_true")
    ap.add_argument("--through-gateway", action="store_true",
                    help="deploy both setups on `modelyard serve`; tenants call through its "
                    "gateway with their own keys")  # fmt: skip
    args = ap.parse_args()
    args.merged = args.tenants if args.merged is None else min(args.merged, args.tenants)
    if args.through_gateway and args.model != "smollm2":
        ap.error("--through-gateway serves the adapters on the public smollm2 that serve deploys")

    folder = to_hf_folder(args.model, EngineSettings().cache_dir)
    cfg = read_model_config(folder)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, cfg.vocab_size - 100, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.requests)
    ]
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        shapes = projection_shapes(cfg)
        for i in range(args.tenants):
            write_adapter(tmp / "adapters" / f"adapter{i}", shapes, cfg.num_hidden_layers,
                          args.rank, i, MODULES)  # fmt: skip
        run = through_gateway if args.through_gateway else direct
        rows = run(args, folder, tmp, prompts)
    where = "through the gateway" if args.through_gateway else "straight to the workers"
    print(
        f"model {args.model} float32, {args.requests} requests x {args.max_tokens} tokens per "
        f"tenant (prompt {args.prompt_len}), adapters rank {args.rank} on every projection, "
        f"KV cache {args.kv_cache} per worker, {where}; machine {platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )
    print(f"{'setup':>44} {'tenants':>7} {'workers':>7} {'tok/s':>7} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'MiB/tenant':>10}")  # fmt: skip
    for label, tenants, n_workers, r in rows:
        mib = r["pss"] / tenants / 2**20
        print(
            f"{label:>44} {tenants:>7} {n_workers:>7} {r['tok_s']:>7.1f} "
            f"{r['ttft_p50']:>8.2f}s {r['ttft_p99']:>8.2f}s {mib:>10.0f}"
        )


if __name__ == "__main__":
    main()
