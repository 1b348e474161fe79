"""The batch runner: moves every active batch through its states, durably.

Items are rows; the runner sends each pending one through the gateway at batch priority
(bounded concurrency per batch), and writes its result the moment it finishes — once: the row
is updated only while still pending, and usage is keyed `<batch id>:<item id>`. Killing the
server or a worker at any point loses nothing: on start every active batch resumes from its
pending rows. Cancel stops dispatching and keeps finished items; a batch past its window expires
with its partial results kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import select, update

from modelyard.api.errors import APIError
from modelyard.batch.files import FileService
from modelyard.batch.service import ACTIVE, TERMINAL, batch_view
from modelyard.batch.validation import BatchFileInvalid, validate_file
from modelyard.batch.webhook import allowed, deliver
from modelyard.config import PlatformSettings
from modelyard.gateway.auth import Principal
from modelyard.gateway.metering import UsageEvent
from modelyard.gateway.proxy import Gateway
from modelyard.gateway.ratelimit import Limits
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import ApiKey, Batch, BatchItem, Tenant

log = logging.getLogger(__name__)

_KIND = {
    "/v1/chat/completions": "chat.completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
# Failures worth another try: nothing reached a model, or the model's server broke.
_TRANSIENT = {499, 500, 502, 503, 504}


class BatchRunner:
    def __init__(
        self,
        settings: PlatformSettings,
        db: Database,
        files: FileService,
        gateway: Gateway,
    ) -> None:
        self.settings = settings
        self.db = db
        self.files = files
        self.gateway = gateway
        self.webhook_secret = settings.batch_webhook_secret or self._local_secret()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._webhooks: set[asyncio.Task[None]] = set()

    def _local_secret(self) -> str:
        path: Path = self.settings.data_dir / "webhook_secret"
        if not path.exists():
            path.write_text(secrets.token_hex(32))
            path.chmod(0o600)
        return path.read_text().strip()

    # ----- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop_task, *self._tasks.values(), *self._webhooks) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        first = True
        while True:
            try:
                for batch_id in await asyncio.to_thread(self._active_ids):
                    if batch_id not in self._tasks:
                        task = asyncio.create_task(self._process(batch_id), name=batch_id)
                        self._tasks[batch_id] = task
                        task.add_done_callback(lambda t, b=batch_id: self._tasks.pop(b, None))
                if first:
                    await self._resend_webhooks()
                    first = False
            except Exception:
                log.exception("batch runner loop failed; retrying")
            await asyncio.sleep(self.settings.batch_poll_interval_s)

    def _active_ids(self) -> list[str]:
        with self.db.session() as s:
            return list(s.scalars(select(Batch.id).where(Batch.status.in_(ACTIVE))))

    def _load(self, batch_id: str) -> Batch:
        with self.db.session() as s:
            b = s.get(Batch, batch_id)
            assert b is not None
            return b

    def _set(self, batch_id: str, **fields: Any) -> Batch:
        with self.db.session() as s:
            b = s.get(Batch, batch_id)
            assert b is not None
            for k, v in fields.items():
                setattr(b, k, v)
            return b

    # ----- one batch -------------------------------------------------------------------------

    async def _process(self, batch_id: str) -> None:
        try:
            batch = await asyncio.to_thread(self._load, batch_id)
            if batch.status == "validating":
                batch = await asyncio.to_thread(self._validate, batch)
            if batch.status == "in_progress":
                batch = await self._run_items(batch)
            if batch.status in ("finalizing", "cancelling"):
                await asyncio.to_thread(self._finalize, batch_id)
            batch = await asyncio.to_thread(self._load, batch_id)
            if batch.status in TERMINAL:
                self._notify(batch)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: processing failed; it will be retried", batch_id)

    def _validate(self, batch: Batch) -> Batch:
        path = self.files.content_path(batch.tenant_id, batch.input_file_id)
        try:
            good, bad = validate_file(path, batch.endpoint)
        except BatchFileInvalid as exc:
            now = repo.now()
            return self._set(
                batch.id,
                status="failed",
                failed_at=now,
                errors={"object": "list", "data": exc.errors},
            )
        with self.db.session() as s:
            b = s.get(Batch, batch.id)
            assert b is not None
            if b.status != "validating":  # cancelled meanwhile
                return b
            s.add_all(
                BatchItem(batch_id=b.id, line=g.line, custom_id=g.custom_id, body=g.body,
                          status="pending")
                for g in good
            )  # fmt: skip
            # A bad line is finished at once: it goes to the error file, the rest goes on.
            s.add_all(
                BatchItem(
                    batch_id=b.id, line=x.line, custom_id=x.custom_id or f"line-{x.line}",
                    valid=False, body=None, status="error", status_code=400, response=None,
                    error={"code": x.code, "message": x.message, "line": x.line},
                    finished_at=repo.now(),
                )
                for x in bad
            )  # fmt: skip
            b.total = len(good) + len(bad)
            b.failed = len(bad)
            b.status = "in_progress"
            b.in_progress_at = repo.now()
            return b

    def _pending(self, batch_id: str) -> list[tuple[int, str, dict[str, Any]]]:
        with self.db.session() as s:
            rows = s.execute(
                select(BatchItem.id, BatchItem.custom_id, BatchItem.body)
                .where(BatchItem.batch_id == batch_id, BatchItem.status == "pending")
                .order_by(BatchItem.line)
            ).all()
        return [(r[0], r[1], r[2]) for r in rows]

    async def _principal(self, batch: Batch) -> Principal:
        def load() -> Principal:
            with self.db.session() as s:
                key = s.get(ApiKey, batch.key_id)
                tenant = s.get(Tenant, batch.tenant_id)
                assert tenant is not None
                return Principal(
                    key_id=batch.key_id,
                    key_name=key.name if key else "",
                    tenant_id=tenant.id,
                    tenant_name=tenant.name,
                    scopes=frozenset({"inference"}),
                    limits=Limits(None, None),
                    monthly_token_quota=tenant.monthly_token_quota,
                    platform_admin=False,
                )

        return await asyncio.to_thread(load)

    async def _run_items(self, batch: Batch) -> Batch:
        principal = await self._principal(batch)
        kind = _KIND[batch.endpoint]
        pending = await asyncio.to_thread(self._pending, batch.id)
        semaphore = asyncio.Semaphore(self.settings.batch_concurrency)
        in_flight: set[asyncio.Task[None]] = set()
        stop_reason: str | None = None
        for item_id, custom_id, body in pending:
            await semaphore.acquire()
            current = await asyncio.to_thread(self._load, batch.id)
            if current.status == "cancelling":
                stop_reason = "cancelled"
            elif repo.now() >= repo.as_utc(current.expires_at):
                stop_reason = "expired"
            if stop_reason:
                semaphore.release()
                break
            task = asyncio.create_task(
                self._run_item(principal, kind, batch.id, item_id, custom_id, body)
            )
            in_flight.add(task)
            task.add_done_callback(lambda t: (in_flight.discard(t), semaphore.release()))
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
        if stop_reason == "expired":
            await asyncio.to_thread(self._expire_pending, batch.id)
            return self._set(batch.id, status="finalizing", expired_at=repo.now())
        current = await asyncio.to_thread(self._load, batch.id)
        if current.status == "cancelling":
            return current
        return self._set(batch.id, status="finalizing", finalizing_at=repo.now())

    async def _run_item(
        self,
        principal: Principal,
        kind: str,
        batch_id: str,
        item_id: int,
        custom_id: str,
        body: dict[str, Any],
    ) -> None:
        request_id = f"{batch_id}:{item_id}"
        delay = 1.0
        status, result = 500, {"error": {"message": "not run", "type": "server_error"}}
        usage: UsageEvent | None = None
        for attempt in range(self.settings.batch_item_attempts):
            try:
                status, result, usage = await self.gateway.run_internal(
                    principal, kind, body, request_id
                )
            except APIError as exc:
                status, result = exc.status, exc.body()
            except Exception as exc:  # a bug must not stop the batch: the item records it
                log.exception("batch %s item %s failed", batch_id, custom_id)
                status = 500
                result = {"error": {"message": repr(exc), "type": "server_error"}}
            if status not in _TRANSIENT or attempt == self.settings.batch_item_attempts - 1:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
        first = await asyncio.to_thread(
            self._record, batch_id, item_id, request_id, status, result, usage
        )
        if first and usage is not None:
            await self.gateway.recorder.count(usage)

    def _record(
        self,
        batch_id: str,
        item_id: int,
        request_id: str,
        status: int,
        result: dict[str, Any],
        usage: UsageEvent | None,
    ) -> bool:
        """Write the item's result and its usage row in one transaction; False if the item
        had been recorded before (then neither is written again)."""
        ok = status == 200
        error = None
        if not ok:
            err = result.get("error") if isinstance(result, dict) else None
            err = err if isinstance(err, dict) else {"message": str(result)}
            error = {"code": err.get("code") or err.get("type"), "message": err.get("message")}
        with self.db.session() as s:
            changed = s.execute(
                update(BatchItem)
                .where(BatchItem.id == item_id, BatchItem.status == "pending")
                .values(
                    status="done" if ok else "error",
                    status_code=status,
                    response=result,
                    error=error,
                    request_id=request_id,
                    finished_at=repo.now(),
                )
            ).rowcount
            if changed:
                counter = Batch.completed if ok else Batch.failed
                s.execute(update(Batch).where(Batch.id == batch_id).values({counter: counter + 1}))
                if usage is not None:
                    repo.insert_usage(s, [asdict(usage)])
            return bool(changed)

    def _expire_pending(self, batch_id: str) -> None:
        with self.db.session() as s:
            n = s.execute(
                update(BatchItem)
                .where(BatchItem.batch_id == batch_id, BatchItem.status == "pending")
                .values(
                    status="error",
                    error={"code": "batch_expired",
                           "message": "This request could not be executed before the "
                                      "completion window expired."},
                    finished_at=repo.now(),
                )
            ).rowcount  # fmt: skip
            s.execute(update(Batch).where(Batch.id == batch_id).values(failed=Batch.failed + n))

    # ----- output files ----------------------------------------------------------------------

    @staticmethod
    def _line(item: BatchItem) -> bytes:
        response = None
        if item.response is not None and item.status_code is not None:
            response = {
                "status_code": item.status_code,
                "request_id": item.request_id,
                "body": item.response,
            }
        return orjson.dumps(
            {
                "id": f"batch_req_{item.id}",
                "custom_id": item.custom_id,
                "response": response,
                "error": item.error,
            }
        )

    def _finalize(self, batch_id: str) -> None:
        with self.db.session() as s:
            b = s.get(Batch, batch_id)
            assert b is not None
            items = list(
                s.scalars(
                    select(BatchItem)
                    .where(BatchItem.batch_id == batch_id, BatchItem.status != "pending")
                    .order_by(BatchItem.line)
                )
            )
            done = b"\n".join(self._line(i) for i in items if i.status == "done")
            failed = b"\n".join(self._line(i) for i in items if i.status == "error")
            # The files and the batch's new state commit together: no half-finalized batch.
            output = errors = None
            if done:
                sha, size = self.files.store_bytes(done + b"\n")
                output = self.files.add_record(
                    s, b.tenant_id, sha, size, f"{b.id}_output.jsonl", "batch_output"
                )
            if failed:
                sha, size = self.files.store_bytes(failed + b"\n")
                errors = self.files.add_record(
                    s, b.tenant_id, sha, size, f"{b.id}_error.jsonl", "batch_output"
                )
            b.output_file_id = output.id if output else None
            b.error_file_id = errors.id if errors else None
            now = repo.now()
            if b.status == "cancelling":
                b.status, b.cancelled_at = "cancelled", now
            elif b.expired_at is not None:
                b.status = "expired"
            else:
                b.status, b.completed_at = "completed", now

    # ----- webhooks --------------------------------------------------------------------------

    def _webhook_url(self, batch: Batch) -> str | None:
        url = (batch.metadata_ or {}).get("webhook_url")
        if url and allowed(url, self.settings.batch_webhook_hosts):
            return str(url)
        if url:
            log.warning("batch %s: webhook_url host not in MODELYARD_BATCH_WEBHOOK_HOSTS", batch.id)
        return self.settings.batch_webhook_url

    def _notify(self, batch: Batch) -> None:
        url = self._webhook_url(batch)
        if url is None or batch.webhook_delivered_at is not None:
            return

        async def send() -> None:
            if await deliver(url, self.webhook_secret, batch_view(batch)):
                await asyncio.to_thread(self._set, batch.id, webhook_delivered_at=repo.now())

        task = asyncio.create_task(send())
        self._webhooks.add(task)
        task.add_done_callback(self._webhooks.discard)

    async def _resend_webhooks(self) -> None:
        """After a restart: batches that ended in the last day but were never announced."""
        since = repo.now() - timedelta(days=1)

        def load() -> list[Batch]:
            with self.db.session() as s:
                return list(
                    s.scalars(
                        select(Batch).where(
                            Batch.status.in_(TERMINAL),
                            Batch.webhook_delivered_at.is_(None),
                            Batch.created_at >= since,
                        )
                    )
                )

        for batch in await asyncio.to_thread(load):
            with contextlib.suppress(Exception):
                self._notify(batch)
