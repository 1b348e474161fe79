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

    python benchmarks/lora_tenants.py --tenants 5
    python benchmarks/lora_tenants.py --tenants 50 --merged 5 --requests 2
"""

from __future__ import annotations

import argparse
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

import httpx
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lora import MODULES, write_adapter
from modelyard.config import EngineSettings
from modelyard.engine.lora.adapter import projection_shapes
from modelyard.engine.models.loader import read_model_config, to_hf_folder


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

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def tenant_load(
    url: str, model: str, prompts: list[list[int]], max_tokens: int, ttfts: list[float]
) -> int:
    """One tenant's requests in turn; returns the tokens it got, appends its TTFTs."""
    tokens = 0
    with httpx.Client(timeout=3600.0) as client:
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            started, first = time.perf_counter(), None
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:  # the stream's error event
                        raise RuntimeError(f"{model}: {chunk['error']}")
                    if first is None and chunk.get("choices"):  # a token (its text may be
                        # empty: a random prompt's first token can be part of a character)
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
            assert first is not None, "no token streamed"
            ttfts.append(first - started)
    return tokens


def drive(targets: list[tuple[str, str]], prompts: list[list[int]], max_tokens: int) -> dict:
    """Every tenant's load at once; (url, model) per tenant."""
    ttfts: list[float] = []
    counts = [0] * len(targets)

    def one(i: int) -> None:
        url, model = targets[i]
        counts[i] = tenant_load(url, model, prompts, max_tokens, ttfts)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(targets))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    ttfts.sort()
    return {
        "tokens": sum(counts),
        "seconds": seconds,
        "tok_s": sum(counts) / seconds,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    }


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
    args = ap.parse_args()
    merged_n = args.tenants if args.merged is None else args.merged

    folder = to_hf_folder(args.model, EngineSettings().cache_dir)
    cfg = read_model_config(folder)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, cfg.vocab_size - 100, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.requests)
    ]
    common = {"MODELYARD_DTYPE": "float32", "MODELYARD_KV_CACHE_MEMORY": args.kv_cache,
              "MODELYARD_MAX_NUM_SEQS": str(max(16, args.tenants))}  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        adapters = Path(tmp) / "adapters"
        shapes = projection_shapes(cfg)
        for i in range(args.tenants):
            write_adapter(adapters / f"adapter{i}", shapes, cfg.num_hidden_layers, args.rank, i,
                          MODULES)  # fmt: skip
        env = {
            **common,
            "MODELYARD_MAX_LORAS": str(args.tenants),
            "MODELYARD_MAX_LORA_RANK": str(args.rank),
            "MODELYARD_LORA_DIR": str(adapters),
        }
        shared = Worker(folder, "base", env, args.port)
        try:
            shared.wait_ready()
            targets = [(shared.url, f"base:adapter{i}") for i in range(args.tenants)]
            drive(targets, prompts[:1], 2)  # warm-up: every adapter into its slot
            result = drive(targets, prompts, args.max_tokens)
            result["pss"] = pss_bytes(shared.proc.pid)
            rows.append(("shared: 1 worker, base + adapters", args.tenants, 1, result))
            print(rows[-1], flush=True)
        finally:
            shared.stop()
        if not args.skip_merged:
            workers = []
            try:
                for i in range(merged_n):
                    out = Path(tmp) / f"merged{i}"
                    merge(folder, adapters / f"adapter{i}", out, args.rank)
                    workers.append(Worker(out, "merged", common, args.port + 1 + i))
                for w in workers:
                    w.wait_ready()
                targets = [(w.url, "merged") for w in workers]
                drive(targets, prompts[:1], 2)
                result = drive(targets, prompts, args.max_tokens)
                result["pss"] = sum(pss_bytes(w.proc.pid) for w in workers)
                rows.append(("merged: 1 worker per tenant", merged_n, merged_n, result))
                print(rows[-1], flush=True)
            finally:
                for w in workers:
                    w.stop()
    print(
        f"model {args.model} float32, {args.requests} requests x {args.max_tokens} tokens per "
        f"tenant (prompt {args.prompt_len}), adapters rank {args.rank} on every projection, "
        f"KV cache {args.kv_cache} per worker; machine {platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )
    print(f"{'setup':>36} {'tenants':>7} {'workers':>7} {'tok/s':>7} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'MiB/tenant':>10}")  # fmt: skip
    for label, tenants, n_workers, r in rows:
        mib = r["pss"] / tenants / 2**20
        print(
            f"{label:>36} {tenants:>7} {n_workers:>7} {r['tok_s']:>7.1f} "
            f"{r['ttft_p50']:>8.2f}s {r['ttft_p99']:>8.2f}s {mib:>10.0f}"
        )


if __name__ == "__main__":
    main()
