"""Gateway overhead: short requests straight to a worker vs through the gateway, same run.

Starts `modelyard serve` (no default models), deploys a tiny random-weight Llama so that the
worker's own time is small and the gateway's share shows, creates a tenant key with RPM/TPM
limits (so the limiter runs) under a monthly quota (so the quota check runs), and sends the
same chat request (max_tokens=1) both ways:

  * latency: sequential requests on a keep-alive connection, direct and gateway interleaved so
    drift hits both alike; p50/p99 and the added p50;
  * throughput: a fixed number of concurrent clients for a fixed time; requests/s each way,
    and the gateway process's own CPU time per request while it ran (user + system, from
    /proc): what one gateway core can carry, the number `docs/scaling.md` projects from.

`--stores postgres-redis` runs the platform on the machine's PostgreSQL and Redis (a fresh
database and Redis database number), as cluster gateways run, instead of SQLite and memory.

    python benchmarks/gateway_overhead.py [--requests 400] [--concurrency 16] [--seconds 10]
                                          [--stores sqlite-memory|postgres-redis]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modelyard.core.cluster_auth import CLUSTER_SECRET_ENV, worker_token
from tests.databases import platform_mode_env
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
)
from tests.tiny_models import build_model

SECRET = "gateway-overhead-benchmark-secret-0123456789"
BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 1,
    "temperature": 0,
}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def latency(
    direct: str, direct_headers: dict[str, str], gateway: str, key: str, n: int
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "gateway": []}
    with (
        httpx.Client(timeout=30, headers=direct_headers) as d,
        httpx.Client(timeout=30, headers={"authorization": f"Bearer {key}"}) as g,
    ):
        for _ in range(20):  # warm connections and caches
            d.post(f"{direct}/v1/chat/completions", json=BODY)
            g.post(f"{gateway}/v1/chat/completions", json=BODY)
        for _ in range(n):
            for name, client, url in (("direct", d, direct), ("gateway", g, gateway)):
                t0 = time.perf_counter()
                r = client.post(f"{url}/v1/chat/completions", json=BODY)
                out[name].append((time.perf_counter() - t0) * 1000)
                assert r.status_code == 200, r.text
    return out


async def throughput(
    url: str, headers: dict[str, str], concurrency: int, seconds: float
) -> tuple[float, int]:
    """Requests/s, and how many were answered."""
    done = 0
    stop = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        async with httpx.AsyncClient(timeout=30, headers=headers) as c:
            while time.perf_counter() < stop:
                r = await c.post(f"{url}/v1/chat/completions", json=BODY)
                assert r.status_code == 200, r.text
                done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0), done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument(
        "--stores", choices=("sqlite-memory", "postgres-redis"), default="sqlite-memory"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    model = build_model(work / "tiny", "llama")
    engine = json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"})
    with contextlib.ExitStack() as stack:
        stores = stack.enter_context(platform_mode_env(args.stores))
        # A known cluster secret: the replicas demand the worker token derived from it, which
        # the direct requests carry as the platform's own do.
        env = {"MODELYARD_WORKER_ENGINE": engine, CLUSTER_SECRET_ENV: SECRET, **stores}
        platform = PlatformProcess(work / "data", env).start()
        stack.callback(platform.stop)
        report = measure(platform, model, args)
    report["stores"] = args.stores
    print(json.dumps(report, indent=2))
    print(
        f"\nlatency p50/p99: direct {report['direct_p50_ms']}/{report['direct_p99_ms']} ms, "
        f"gateway {report['gateway_p50_ms']}/{report['gateway_p99_ms']} ms "
        f"(added p50 {report['added_p50_ms']} ms)\n"
        f"throughput at {args.concurrency} clients: direct {report['direct_rps']} req/s, "
        f"gateway {report['gateway_rps']} req/s, the gateway process's CPU "
        f"{report['gateway_cpu_ms_per_request']} ms per request; "
        f"metered {report['metered_requests']} requests ({args.stores})"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def measure(platform: PlatformProcess, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    admin = platform.api()
    endpoint = deploy(admin, "tiny", str(model), public=True)
    worker = admin.get(f"/v1/endpoints/{endpoint}").json()["replicas"]["items"][0]["address"]
    tenant = create_tenant(admin, "bench", quota=10**12)
    key = create_key(admin, tenant, rpm_limit=10**7, tpm_limit=10**9)["key"]

    direct = {"authorization": f"Bearer {worker_token(SECRET)}"}
    lat = latency(worker, direct, platform.url, key, args.requests)
    rps_direct, _ = asyncio.run(throughput(worker, direct, args.concurrency, args.seconds))
    cpu_before = cpu_seconds(platform.proc.pid)
    rps_gateway, answered = asyncio.run(
        throughput(platform.url, {"authorization": f"Bearer {key}"}, args.concurrency, args.seconds)
    )
    cpu_ms = (cpu_seconds(platform.proc.pid) - cpu_before) * 1000 / answered
    time.sleep(0.5)
    usage = admin.get("/v1/usage", params={"tenant_id": tenant}).json()["totals"]

    return {
        "requests_each_way": args.requests,
        "direct_p50_ms": round(pct(lat["direct"], 50), 2),
        "direct_p99_ms": round(pct(lat["direct"], 99), 2),
        "gateway_p50_ms": round(pct(lat["gateway"], 50), 2),
        "gateway_p99_ms": round(pct(lat["gateway"], 99), 2),
        "added_p50_ms": round(
            statistics.median(lat["gateway"]) - statistics.median(lat["direct"]), 2
        ),
        "concurrency": args.concurrency,
        "direct_rps": round(rps_direct, 1),
        "gateway_rps": round(rps_gateway, 1),
        "gateway_cpu_ms_per_request": round(cpu_ms, 3),
        "metered_requests": usage["requests"],
    }


if __name__ == "__main__":
    main()
