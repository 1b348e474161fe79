"""One batch runner in a process of its own, for tests of runners sharing a database
(`tests/batch/test_batch_leases.py`): the real `BatchRunner` on the given database and data dir,
with a stand-in sender that answers each item after `--hold` seconds and appends
`sent OWNER REQUEST_ID`
to `--log` (one `os.write` per line, O_APPEND, so two processes' lines never interleave).

    python -m tests.batch_runner_proc --db URL --data DIR --owner NAME --lease S --hold S --log F
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

from modelyard.batch.files import FileService
from modelyard.batch.runner import BatchRunner
from modelyard.config import PlatformSettings
from modelyard.core.identity import Principal
from modelyard.core.routing import RoutingTable
from modelyard.gateway.accounting import ItemUsage
from modelyard.gateway.metering import UsageEvent
from modelyard.store.artifacts import ArtifactStore
from modelyard.store.db import Database


class LoggingSender:
    def __init__(self, owner: str, log: Path, hold_s: float) -> None:
        self.owner = owner
        self.fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.hold_s = hold_s

    async def run_internal(
        self, principal: Principal, kind: str, payload: dict[str, Any], request_id: str
    ) -> tuple[int, dict[str, Any], ItemUsage | None]:
        os.write(self.fd, f"sent {self.owner} {request_id}\n".encode())
        await asyncio.sleep(self.hold_s)
        usage = UsageEvent(
            request_id=request_id, tenant_id=principal.tenant_id, key_id=principal.key_id,
            endpoint_id=None, model="tiny", version_id=None, kind=kind, prompt_tokens=3,
            completion_tokens=2, cached_tokens=0, latency_ms=1.0, ttft_ms=None,
            status_code=200, status="ok", batch=True,
        )  # fmt: skip
        return (
            200,
            {"object": "chat.completion", "usage": {"total_tokens": 5}},
            ItemUsage(usage, None),
        )

    async def settle_item(self, usage: ItemUsage, recorded: bool) -> None:
        """No quota here (its tenants have none): nothing is held to settle."""
        assert usage.held is None


async def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--db", "--data", "--owner", "--log"):
        parser.add_argument(name, required=True)
    parser.add_argument("--lease", type=float, required=True)
    parser.add_argument("--hold", type=float, required=True)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    data = Path(args.data)
    settings = PlatformSettings(
        data_dir=data,
        database_url=args.db,
        batch_poll_interval_s=0.05,
        batch_lease_s=args.lease,
        batch_concurrency=args.concurrency,
    )
    db = Database(args.db)
    files = FileService(db, ArtifactStore(data / "artifacts"), 1 << 30)
    sender = LoggingSender(args.owner, Path(args.log), args.hold)
    runner = BatchRunner(
        settings, db, files, sender=sender, routing=RoutingTable(), owner=args.owner
    )
    runner.start()
    (data / f"ready-{args.owner}").touch()
    await asyncio.Event().wait()  # until killed


if __name__ == "__main__":
    asyncio.run(main())
