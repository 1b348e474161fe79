"""The batch runner: moves every active batch through its states, durably.

Items are rows; the runner sends each pending one through the gateway at batch priority, within
the tenant's share of the batch budget (`BatchBudget`, which also makes batch work wait while
interactive requests queue), and writes its result the moment it finishes — once: the row is
updated only while still pending (and while the batch's key is not revoked), and usage is keyed
`<batch id>:<item id>`. Killing the server or a worker at any point loses nothing: on start every
active batch resumes from its pending rows. Cancel stops dispatching and keeps finished items; a
batch past its window expires with its partial results kept; a batch whose key is revoked stops
at once (items in flight are abandoned, nothing more is billed) and ends cancelled, saying why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import InterfaceError, OperationalError

from modelyard.batch.budget import BatchBudget
from modelyard.batch.files import FileService
from modelyard.batch.items import ItemRunner, load_principal
from modelyard.batch.notify import Notifier
from modelyard.batch.outputs import expire_pending, finalize
from modelyard.batch.service import ACTIVE, TERMINAL, BatchStatus, ItemStatus
from modelyard.batch.validation import BatchFileInvalid, validate_file
from modelyard.batch.webhook_policy import WebhookPolicy
from modelyard.config import PlatformSettings
from modelyard.core.identity import Principal
from modelyard.core.routing import EndpointRoute
from modelyard.gateway.proxy import Gateway
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import ApiKey, Batch, BatchItem

log = logging.getLogger(__name__)

_KIND = {
    "/v1/chat/completions": "chat.completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
# How often the runner looks for a revoked key while it only waits for items in flight.
_WATCH_S = 0.5
_REVOKED_ERROR = {
    "code": "api_key_revoked",
    "message": "The API key that created this batch was revoked: no further requests were "
    "sent; requests that had finished keep their results.",
    "param": None,
    "line": None,
}


class Stop(StrEnum):
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    REVOKED = "revoked"


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
        self.budget = BatchBudget(settings.batch_concurrency, settings.batch_max_concurrency)
        self.items = ItemRunner(settings, db, gateway)
        self.notifier = Notifier(settings, db, WebhookPolicy(settings.batch_webhook_hosts))
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        # batch id → (monotonic time of its next try, failures so far): a batch whose
        # processing keeps failing is retried with backoff, not every poll.
        self._backoff: dict[str, tuple[float, int]] = {}

    # ----- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop_task, *self._tasks.values()) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.notifier.stop()

    async def _loop(self) -> None:
        first = True
        down = False  # the database is unreachable: one warning per outage, not per poll
        while True:
            try:
                now = time.monotonic()
                for batch_id in await asyncio.to_thread(self._active_ids):
                    if batch_id in self._tasks or self._backoff.get(batch_id, (0, 0))[0] > now:
                        continue
                    task = asyncio.create_task(self._process(batch_id), name=batch_id)
                    self._tasks[batch_id] = task
                    task.add_done_callback(lambda t, b=batch_id: self._tasks.pop(b, None))
                if first:
                    await self.notifier.resend()
                    first = False
                if down:
                    log.warning("batch runner: the database answers again")
                    down = False
            except (OperationalError, InterfaceError) as exc:
                if not down:
                    log.warning("batch runner: the database is unreachable, polling on: %s", exc)
                    down = True
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
            if batch.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
                stop = await asyncio.to_thread(self._stop_reason, batch_id)
                if stop is Stop.REVOKED:
                    batch = await asyncio.to_thread(self._end_revoked, batch_id)
                elif stop is Stop.EXPIRED and batch.status == BatchStatus.VALIDATING:
                    batch = await asyncio.to_thread(
                        self._set, batch_id, status=BatchStatus.FINALIZING, expired_at=repo.now()
                    )
            if batch.status == BatchStatus.VALIDATING:
                batch = await asyncio.to_thread(self._validate, batch)
            if batch.status == BatchStatus.IN_PROGRESS:
                batch = await self._run_items(batch)
            if batch.status in (BatchStatus.FINALIZING, BatchStatus.CANCELLING):
                await asyncio.to_thread(finalize, self.db, self.files, batch_id)
            batch = await asyncio.to_thread(self._load, batch_id)
            if batch.status in TERMINAL:
                self.notifier.notify(batch)
            self._backoff.pop(batch_id, None)
        except asyncio.CancelledError:
            raise
        except Exception:
            _, failures = self._backoff.get(batch_id, (0.0, 0))
            delay = min(self.settings.batch_poll_interval_s * 2**failures, 60.0)
            self._backoff[batch_id] = (time.monotonic() + delay, failures + 1)
            log.exception("batch %s: processing failed; retried in %.1f s", batch_id, delay)

    def _stop_reason(self, batch_id: str) -> Stop | None:
        """Why dispatching must stop now, if it must: one small query, run before each item."""
        with self.db.session() as s:
            status, expires_at, key_id, revoked_at = s.execute(
                select(Batch.status, Batch.expires_at, ApiKey.id, ApiKey.revoked_at)
                .outerjoin(ApiKey, ApiKey.id == Batch.key_id)
                .where(Batch.id == batch_id)
            ).one()
        if key_id is None or revoked_at is not None:
            return Stop.REVOKED
        if status == BatchStatus.CANCELLING:
            return Stop.CANCELLED
        if repo.now() >= repo.as_utc(expires_at):
            return Stop.EXPIRED
        return None

    def _end_revoked(self, batch_id: str) -> Batch:
        """The key is gone: the batch ends cancelled (finished items kept), saying why."""
        with self.db.session() as s:
            b = s.get(Batch, batch_id)
            assert b is not None
            if b.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
                b.status = BatchStatus.CANCELLING
                b.cancelling_at = repo.now()
                b.errors = {"object": "list", "data": [_REVOKED_ERROR]}
            return b

    def _fail(self, batch_id: str, errors: list[dict[str, Any]]) -> Batch:
        return self._set(
            batch_id,
            status=BatchStatus.FAILED,
            failed_at=repo.now(),
            errors={"object": "list", "data": errors},
        )

    def _validate(self, batch: Batch) -> Batch:
        path = self.files.find_content_path(batch.tenant_id, batch.input_file_id)
        try:
            if path is None:
                raise FileNotFoundError(batch.input_file_id)
            good, bad = validate_file(path, batch.endpoint)
        except FileNotFoundError:
            missing = {
                "code": "input_file_missing",
                "message": f"The input file {batch.input_file_id} was deleted before the "
                "batch could read it.",
                "param": "input_file_id",
                "line": None,
            }
            return self._fail(batch.id, [missing])
        except BatchFileInvalid as exc:
            return self._fail(batch.id, exc.errors)
        with self.db.session() as s:
            b = s.get(Batch, batch.id)
            assert b is not None
            if b.status != BatchStatus.VALIDATING:  # cancelled meanwhile
                return b
            s.add_all(
                BatchItem(batch_id=b.id, line=g.line, custom_id=g.custom_id, body=g.body,
                          status=ItemStatus.PENDING)
                for g in good
            )  # fmt: skip
            # A bad line is finished at once: it goes to the error file, the rest goes on.
            s.add_all(
                BatchItem(
                    batch_id=b.id, line=x.line, custom_id=x.custom_id or f"line-{x.line}",
                    valid=False, body=None, status=ItemStatus.ERROR, status_code=400,
                    response=None, error={"code": x.code, "message": x.message, "line": x.line},
                    finished_at=repo.now(),
                )
                for x in bad
            )  # fmt: skip
            b.total = len(good) + len(bad)
            b.failed = len(bad)
            b.status = BatchStatus.IN_PROGRESS
            b.in_progress_at = repo.now()
            return b

    def _pending(self, batch_id: str) -> list[tuple[int, str, dict[str, Any]]]:
        with self.db.session() as s:
            rows = s.execute(
                select(BatchItem.id, BatchItem.custom_id, BatchItem.body)
                .where(BatchItem.batch_id == batch_id, BatchItem.status == ItemStatus.PENDING)
                .order_by(BatchItem.line)
            ).all()
        return [(r[0], r[1], r[2]) for r in rows]

    def _route(self, principal: Principal, body: dict[str, Any]) -> EndpointRoute | None:
        model = body.get("model")
        return self.gateway.routing.resolve(principal.tenant_id, model) if model else None

    async def _run_items(self, batch: Batch) -> Batch:
        principal = await asyncio.to_thread(load_principal, self.db, batch)
        tenant = principal.tenant_id
        limit = principal.max_concurrent_batch_items
        kind = _KIND[batch.endpoint]
        pending = await asyncio.to_thread(self._pending, batch.id)
        in_flight: set[asyncio.Task[None]] = set()
        commits: set[asyncio.Task[None]] = set()
        stop: Stop | None = None
        try:
            for item_id, custom_id, body in pending:
                await self.budget.acquire(tenant, limit)
                try:
                    await self.budget.yield_to_interactive(lambda b=body: self._route(principal, b))
                    stop = await asyncio.to_thread(self._stop_reason, batch.id)
                except BaseException:
                    self.budget.release(tenant)
                    raise
                if stop is not None:
                    self.budget.release(tenant)
                    break
                task = asyncio.create_task(
                    self.items.run(principal, kind, batch.id, item_id, custom_id, body, commits)
                )
                in_flight.add(task)
                task.add_done_callback(
                    lambda t: (in_flight.discard(t), self.budget.release(tenant))
                )
            stop = await self._drain(batch.id, in_flight, commits, stop)
        except BaseException:
            # Nothing may keep running behind a retry: the retry would send the same pending
            # items again while these are still in flight.
            await self._abandon(in_flight, commits)
            raise
        await asyncio.gather(*commits, return_exceptions=True)
        if stop is None and await asyncio.to_thread(self._stop_reason, batch.id) is Stop.REVOKED:
            stop = Stop.REVOKED  # revoked while the last items ran: theirs were not recorded
        if stop is Stop.REVOKED:
            return await asyncio.to_thread(self._end_revoked, batch.id)
        if stop is Stop.EXPIRED:
            await asyncio.to_thread(expire_pending, self.db, batch.id)
            return await asyncio.to_thread(
                self._set, batch.id, status=BatchStatus.FINALIZING, expired_at=repo.now()
            )
        current = await asyncio.to_thread(self._load, batch.id)
        if current.status == BatchStatus.CANCELLING:
            return current
        return await asyncio.to_thread(
            self._set, batch.id, status=BatchStatus.FINALIZING, finalizing_at=repo.now()
        )

    async def _drain(
        self,
        batch_id: str,
        in_flight: set[asyncio.Task[None]],
        commits: set[asyncio.Task[None]],
        stop: Stop | None,
    ) -> Stop | None:
        """Wait for the items in flight, watching for the key's revocation meanwhile."""
        while in_flight:
            await asyncio.wait(set(in_flight), timeout=_WATCH_S)
            if in_flight and await asyncio.to_thread(self._stop_reason, batch_id) is Stop.REVOKED:
                await self._abandon(in_flight, commits)
                return Stop.REVOKED
        return stop

    @staticmethod
    async def _abandon(in_flight: set[asyncio.Task[None]], commits: set[asyncio.Task[Any]]) -> None:
        """Cancel the items in flight and wait until they are gone; a result already being
        written is let finish (it was earned, and it is written at most once)."""
        tasks = list(in_flight)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*list(commits), return_exceptions=True)
