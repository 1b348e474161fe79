"""The serving benchmark on one GPU beside its memory-bandwidth roofline (run by benchmarks/gpu.sh).

Starts one server on SmolLM2-135M (the bundled GGUF converted to a Hugging Face folder, bfloat16
on CUDA): `modelyard worker`, or `vllm serve` built by the platform's own vLLM runtime
(`modelyard.control.runtimes.vllm.command`); warms it up, then runs benchmarks/serving.py's
closed-loop load at each concurrency (default 1, 64, 256) and prints, beside the measured output
tokens/s, the roofline it is bounded by:

  bandwidth  device-to-device copy of 1 GiB, measured here (bytes read + bytes written / time);
  step bytes the weights (every parameter once: a decode step reads them all) plus the KV cache
             the step's sequences attend over (concurrency x mean context x KV bytes a token);
  roofline   concurrency / (step bytes / bandwidth) output tokens/s; the weights-only figure too.

Writes `<out>/serving-<server>.json` (rows, roofline, device) and `<out>/serving-<server>.md`.

    python benchmarks/gpu_serving.py --server modelyard --out /tmp/gpu
    python benchmarks/gpu_serving.py --server vllm --vllm /tmp/venv/bin/vllm --out /tmp/gpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import _free_port, _stop, _wait_ready, make_prompts, run_load, summarize
from serving import parse_args as serving_args


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


def model_bytes(folder: Path, itemsize: int) -> tuple[int, int]:
    """(weight bytes at `itemsize` per parameter, KV bytes per token at `itemsize`)."""
    from safetensors import safe_open

    from modelyard.engine.models.loader import read_model_config

    params = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shape = f.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= int(d)
                params += n
    cfg = read_model_config(folder)
    return params * itemsize, cfg.kv_bytes_per_token(itemsize)


def launch(
    args: argparse.Namespace, folder: Path, port: int, slots: int
) -> subprocess.Popen[bytes]:
    if args.server == "vllm":
        from modelyard.control.runtimes import vllm

        cmd = vllm.command(args.vllm, folder, "bench", port, slots, 2048, [])
        env = dict(os.environ)
    else:
        cmd = [sys.executable, "-m", "modelyard.cli", "worker", "--model", str(folder), "--host",
               "127.0.0.1", "--port", str(port), "--served-model-name", "bench"]  # fmt: skip
        env = {
            **os.environ,
            "MODELYARD_DEVICE": "cuda",
            "MODELYARD_MAX_NUM_SEQS": str(slots),
            "MODELYARD_MAX_NUM_BATCHED_TOKENS": "4096",
            "MODELYARD_KV_CACHE_MEMORY": "4GiB",
        }
    log = open(Path(args.out) / f"server-{args.server}.log", "wb")  # noqa: SIM115
    print(f"starting {args.server}: {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


async def measure(args: argparse.Namespace, base: str) -> list[dict[str, Any]]:
    load = serving_args(["--input-len", str(args.input_len), "--output-len", str(args.output_len)])
    await run_load(load, base + "/v1", "bench", make_prompts(load, 4), 4)  # warm-up
    rows = []
    for c in args.concurrencies:
        prompts = make_prompts(load, max(8, 2 * c), seed=1000 + c)
        outcomes, wall = await run_load(load, base + "/v1", "bench", prompts, c)
        row = {"server": args.server, "concurrency": c, **summarize(load, outcomes, wall)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--server", choices=("modelyard", "vllm"), default="modelyard")
    p.add_argument("--vllm", default="vllm", help="the vllm executable (--server vllm)")
    p.add_argument("--out", required=True)
    p.add_argument("--concurrencies", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_serving.py: no GPU (torch.cuda.is_available() is false)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from modelyard.config import EngineSettings
    from modelyard.engine.models.loader import to_hf_folder

    folder = to_hf_folder("smollm2", EngineSettings().cache_dir)
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    weights, kv_per_token = model_bytes(folder, 2)  # bfloat16 on CUDA
    context = args.input_len + args.output_len / 2  # mean context a decode step attends over

    port = _free_port()
    proc = launch(args, folder, port, max(args.concurrencies))
    try:
        asyncio.run(_wait_ready(f"http://127.0.0.1:{port}", proc, 180))
        rows = asyncio.run(measure(args, f"http://127.0.0.1:{port}"))
    finally:
        _stop(proc)

    lines = [
        f"{torch.cuda.get_device_name(device)}: copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
        f"weights {weights / 1e6:.0f} MB (bfloat16), KV {kv_per_token} B/token, "
        f"{args.input_len}+{args.output_len} tokens a request",
        "",
        "| server | concurrency | output tok/s | roofline tok/s (weights + KV) | % of roofline "
        "| roofline, weights only | TTFT p50 ms | TPOT p50 ms | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        c = row["concurrency"]
        roof = c * bandwidth / (weights + c * context * kv_per_token)
        row["roofline_tokens_per_s"] = round(roof, 1)
        row["roofline_weights_only_tokens_per_s"] = round(c * bandwidth / weights, 1)
        lines.append(
            f"| {args.server} | {c} | {row['output_tokens_per_s']} | {roof:,.0f} | "
            f"{100 * row['output_tokens_per_s'] / roof:.1f} % | {c * bandwidth / weights:,.0f} | "
            f"{row['ttft_p50_ms']} | {row['tpot_p50_ms']} | {row['failed']} |"
        )
    table = "\n".join(lines)
    print(table)
    (out / f"serving-{args.server}.md").write_text(table + "\n")
    (out / f"serving-{args.server}.json").write_text(
        json.dumps(
            {
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "device": torch.cuda.get_device_name(device),
                "copy_bandwidth_bytes_per_s": bandwidth,
                "weight_bytes": weights,
                "kv_bytes_per_token": kv_per_token,
                "rows": rows,
            },
            indent=1,
        )
    )
    if any(r["failed"] for r in rows):
        sys.exit(f"{args.server}: some requests failed")


if __name__ == "__main__":
    main()
