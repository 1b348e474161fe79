"""Redis's own CPU per request on the gateway's limits path: what one Redis holds.

Drives the gateway's `Accounting` (as `Admission.admit` and the relay's settlement do) against
a real Redis: admission in one script (both token buckets, the monthly quota reservation, the
tenant's concurrency slot), then settlement (TPM reconciled, the quota moved to the real
count, the slot released), for keys with RPM and TPM limits under tenants with a quota and a
ceiling on requests in flight; `--concurrency` requests in flight at once over `--tenants`
tenants. Redis's CPU comes from its own `INFO cpu` (user + system) before and after, so the
client's time (Python, the usage rows) is not in it: requests/s per Redis core =
1 / (Redis CPU per request).

    python benchmarks/redis_admission.py [--requests 20000] [--concurrency 32] [--tenants 100]
                                         [--redis redis://127.0.0.1:6379/0]

Uses a fresh Redis database number of the machine's Redis (as the tests do) unless `--redis`
names one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redis.asyncio import Redis

from modelyard.core.identity import Limits, Principal
from modelyard.core.routing import EndpointRoute
from modelyard.gateway.accounting import Accounting
from modelyard.gateway.call import NO_LIMITS, Call
from modelyard.gateway.metering import UsageRecorder
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quota import RedisConcurrencyLimiter, RedisQuotaCounter
from modelyard.gateway.ratelimit import RedisRateLimiter
from modelyard.store.db import Database
from tests.databases import fresh_redis


def principal(tenant: int) -> Principal:
    return Principal(
        key_id=f"key-{tenant}",
        key_name="k",
        tenant_id=f"tenant-{tenant}",
        tenant_name="t",
        scopes=frozenset({"inference"}),
        limits=Limits(rpm=10**9, tpm=10**12),
        monthly_token_quota=10**15,
        platform_admin=False,
        max_concurrent_requests=10_000,
    )


async def redis_cpu_s(redis: Redis) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def run(url: str, args: argparse.Namespace, db_path: Path) -> dict[str, Any]:
    redis = Redis.from_url(url, max_connections=args.concurrency + 4)
    db = Database(f"sqlite:///{db_path}")
    db.migrate()
    quota = RedisQuotaCounter(redis)
    accounting = Accounting(
        RedisRateLimiter(redis),
        quota,
        RedisConcurrencyLimiter(redis),
        UsageRecorder(db),
        GatewayMetrics(),
    )
    route = EndpointRoute("ep-1", "tenant-0", "m", True, None, 4096)
    principals = [principal(t) for t in range(args.tenants)]
    counter = iter(range(-args.concurrency * 4, args.requests))  # the first ones warm up
    marks: dict[str, float] = {}

    async def client() -> None:
        for i in counter:
            if i == 0:
                marks["cpu"], marks["wall"] = await redis_cpu_s(redis), time.perf_counter()
            p = principals[i % len(principals)]
            call = Call(p, route, "chat.completions", f"req-{i}", 60, NO_LIMITS)
            await accounting.admit_at_once(call, "m")
            call.prompt_tokens, call.completion_tokens = 20, 30
            await accounting.close(call, served=True)

    try:
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall = time.perf_counter() - marks["wall"]
        cpu = await redis_cpu_s(redis) - marks["cpu"]
    finally:
        await redis.aclose()
        db.engine.dispose()
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "tenants": args.tenants,
        "redis_cpu_us_per_request": round(cpu / args.requests * 1e6, 1),
        "requests_per_redis_core_s": round(args.requests / cpu) if cpu > 0 else None,
        "client_requests_per_s": round(args.requests / wall),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tenants", type=int, default=100)
    ap.add_argument("--redis", help="a Redis URL (default: a fresh database of the local one)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.redis or stack.enter_context(fresh_redis())
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="redis-bench-")))
        report = asyncio.run(run(url, args, work / "usage.db"))
    print(json.dumps(report, indent=2))
    print(
        f"\nRedis CPU {report['redis_cpu_us_per_request']} us per request (admission + "
        f"settlement): {report['requests_per_redis_core_s']} requests/s per Redis core"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
