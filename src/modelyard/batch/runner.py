"""The batch runner: moves every active batch through its states, durably.

Items are rows; the runner claims each pending one with a lease (`leases.ItemLeases`: several
runners, one per controller, share a batch, and one takes over the items of a runner that died
once their leases expire), sends it through the gateway at batch priority, within the tenant's
share of the batch budget (`BatchBudget`, which also makes batch work wait while interactive
requests queue), and writes its result the moment it finishes — once: the row is updated only
while still pending (and while the batch's key is not revoked), and usage is keyed
`<batch id>:<item id>`. Killing the server or a worker at any point loses nothing: on start every
active batch resumes from its pending rows (a restarted runner gives back at once the leases its
killed predecessor held; another runner waits for them to expire). Cancel stops dispatching and
keeps finished items; a batch past its window expires with its partial results kept; a batch
whose key is revoked stops at once (items in flight are abandoned, nothing more is billed) and
ends cancelled, saying why (`stops.py`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import InterfaceError, OperationalError

from modelyard.batch.budget import BatchBudget
from modelyard.batch.files import FileService
from modelyard.batch.intake import validate_batch
from modelyard.batch.items import ItemRunner, ItemSender, load_principal
from modelyard.batch.leases import ItemLeases, runner_identity
from modelyard.batch.notify import Notifier
from modelyard.batch.outputs import expire_pending, finalize
from modelyard.batch.service import ACTIVE, TERMINAL, BatchStatus
from modelyard.batch.stops import Stop, end_revoked, stop_reason
from modelyard.batch.webhook_policy import WebhookPolicy
from modelyard.config import PlatformSettings
from modelyard.core.backfill import Backfill
from modelyard.core.identity import Principal
from modelyard.core.routing import EndpointRoute, RoutingTable
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import Batch

log = logging.getLogger(__name__)

_KIND = {
    "/v1/chat/completions": "chat.completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
# How often the runner looks for a revoked key while it only waits for items in flight.
_WATCH_S = 0.5


class BatchRunner:
    def __init__(
        self,
        settings: PlatformSettings,
        db: Database,
        files: FileService,
        *,
        sender: ItemSender,
        routing: RoutingTable,
        owner: str | None = None,
    ) -> None:
        """`sender` sends an item and settles its quota once committed (the gateway),
        `routing` tells whether its endpoint is busy with interactive requests; `owner` names
        this runner's leases (default: this host and data dir)."""
        self.settings = settings
        self.db = db
        self.files = files
        self.routing = routing
        self.owner = owner or runner_identity(settings.data_dir)
        self.leases = ItemLeases(db, self.owner, settings.batch_lease_s)
        self.budget = BatchBudget(
            settings.batch_concurrency,
            settings.batch_max_concurrency,
            Backfill.of(settings),  # the rule the gateway's replica choice applies too
        )
        self.items = ItemRunner(settings, db, sender, self.owner)
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
        released = False  # the leases a killed predecessor of this runner held, given back
        down = False  # the database is unreachable: one warning per outage, not per poll
        while True:
            try:
                if not released:
                    if n := await asyncio.to_thread(self.leases.release):
                        log.info("batch runner %s: took back %d items it held", self.owner, n)
                    released = True
                now = time.monotonic()
                for batch_id in await asyncio.to_thread(self._active_ids):
                    if batch_id in self._tasks or self._backoff.get(batch_id, (0, 0))[0] > now:
                        continue
                    task = asyncio.create_task(self._process(batch_id), name=batch_id)
                    self._tasks[batch_id] = task
                    task.add_done_callback(functools.partial(self._forget, batch_id))
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

    def _stop_reason(self, batch_id: str) -> Stop | None:
        return stop_reason(self.db, batch_id)

    def _forget(self, batch_id: str, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(batch_id, None)

    async def _process(self, batch_id: str) -> None:
        try:
            batch = await asyncio.to_thread(self._load, batch_id)
            if batch.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
                stop = await asyncio.to_thread(self._stop_reason, batch_id)
                if stop is Stop.REVOKED:
                    batch = await asyncio.to_thread(end_revoked, self.db, batch_id)
                elif stop is Stop.EXPIRED and batch.status == BatchStatus.VALIDATING:
                    batch = await asyncio.to_thread(
                        self._set, batch_id, status=BatchStatus.FINALIZING, expired_at=repo.now()
                    )
            ended_here = False  # by this runner: of several, the one that ends it announces it
            if batch.status == BatchStatus.VALIDATING:
                batch = await asyncio.to_thread(validate_batch, self.db, self.files, batch)
                ended_here = batch.status == BatchStatus.FAILED
            if batch.status == BatchStatus.IN_PROGRESS:
                batch = await self._run_items(batch)
            if batch.status in (BatchStatus.FINALIZING, BatchStatus.CANCELLING):
                ended_here = await asyncio.to_thread(finalize, self.db, self.files, batch_id)
            batch = await asyncio.to_thread(self._load, batch_id)
            if batch.status in TERMINAL and ended_here:
                self.notifier.notify(batch)
            self._backoff.pop(batch_id, None)
        except asyncio.CancelledError:
            raise
        except Exception:
            _, failures = self._backoff.get(batch_id, (0.0, 0))
            delay = min(self.settings.batch_poll_interval_s * 2**failures, 60.0)
            self._backoff[batch_id] = (time.monotonic() + delay, failures + 1)
            log.exception("batch %s: processing failed; retried in %.1f s", batch_id, delay)

    def _route(self, principal: Principal, body: dict[str, Any]) -> EndpointRoute | None:
        model = body.get("model")
        return self.routing.resolve(principal.tenant_id, model) if model else None

    async def _run_items(self, batch: Batch) -> Batch:
        principal = await asyncio.to_thread(load_principal, self.db, batch)
        tenant = principal.tenant_id
        limit = principal.max_concurrent_batch_items
        kind = _KIND[batch.endpoint]
        in_flight: set[asyncio.Task[None]] = set()
        commits: set[asyncio.Task[None]] = set()
        held: set[int] = set()  # leased by this pass and not finished: renewed, released at end
        renewer = asyncio.create_task(self._renew(batch.id, held), name=f"{batch.id}-leases")

        def done(task: asyncio.Task[None], item_id: int) -> None:
            in_flight.discard(task)
            self.budget.release(tenant)
            if not task.cancelled():  # a cancelled item's lease is given back below
                held.discard(item_id)

        stop: Stop | None = None
        try:
            while stop is None:
                await self.budget.acquire(tenant, limit)
                try:
                    item = await asyncio.to_thread(self.leases.claim, batch.id, set(held))
                    if item is not None:
                        held.add(item.id)
                        await self._wait_for_room(batch.id, principal, item.body)
                        stop = await asyncio.to_thread(self._stop_reason, batch.id)
                except BaseException:
                    self.budget.release(tenant)
                    raise
                if item is None:
                    self.budget.release(tenant)
                    if not await self._more_to_claim(batch.id, in_flight):
                        break
                    stop = await asyncio.to_thread(self._stop_reason, batch.id)
                    continue
                if stop is not None:
                    self.budget.release(tenant)
                    break
                task = asyncio.create_task(
                    self.items.run(
                        principal, kind, batch.id, item.id, item.custom_id, item.body, commits
                    )
                )
                in_flight.add(task)
                task.add_done_callback(functools.partial(done, item_id=item.id))
            stop = await self._drain(batch.id, in_flight, commits, stop)
        except BaseException:
            # Nothing may keep running behind a retry: the retry would send the same pending
            # items again while these are still in flight.
            await self._abandon(in_flight, commits)
            raise
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            await self._give_back(held)
        await asyncio.gather(*commits, return_exceptions=True)
        if stop is None and await asyncio.to_thread(self._stop_reason, batch.id) is Stop.REVOKED:
            stop = Stop.REVOKED  # revoked while the last items ran: theirs were not recorded
        if stop is Stop.REVOKED:
            return await asyncio.to_thread(end_revoked, self.db, batch.id)
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

    async def _wait_for_room(
        self, batch_id: str, principal: Principal, body: dict[str, Any]
    ) -> None:
        """Hold the item while its endpoint has no room for it (`BatchBudget`), looking for a
        stop meanwhile: interactive traffic can keep the endpoint full for hours, and a
        cancelled or expired batch must not wait on it."""
        room = asyncio.ensure_future(
            self.budget.yield_to_interactive(functools.partial(self._route, principal, body))
        )
        try:
            while not room.done():
                await asyncio.wait({room}, timeout=_WATCH_S)
                if room.done():
                    break
                stop = await asyncio.to_thread(self._stop_reason, batch_id)
                if stop is not None:
                    return  # the caller reads it again
        finally:
            room.cancel()

    async def _more_to_claim(self, batch_id: str, in_flight: set[asyncio.Task[None]]) -> bool:
        """Nothing is claimable now: wait for one of this runner's items, or (with none in
        flight) for other runners' items to finish or their leases to expire. False once no
        item of the batch is pending at all."""
        if in_flight:
            await asyncio.wait(set(in_flight), timeout=_WATCH_S, return_when="FIRST_COMPLETED")
            return True
        if await asyncio.to_thread(self.leases.pending, batch_id) == 0:
            return False
        await asyncio.sleep(min(self.settings.batch_poll_interval_s * 2, self.leases.lease_s / 4))
        return True

    async def _renew(self, batch_id: str, held: set[int]) -> None:
        """Keep this pass's leases alive while its items run (three renewals per lease)."""
        while True:
            await asyncio.sleep(self.leases.lease_s / 3)
            mine = set(held)
            try:
                kept = await asyncio.to_thread(self.leases.renew, mine)
            except Exception as exc:  # the database is down: the leases may lapse meanwhile
                log.warning("batch %s: renewing item leases failed: %s", batch_id, exc)
                continue
            if lost := (mine - kept) & held:
                # Taken over after this runner stalled past its lease: whichever run finishes
                # first is recorded, the other is not (the item's status decides).
                log.warning("batch %s: leases of items %s were taken over", batch_id, sorted(lost))

    async def _give_back(self, held: set[int]) -> None:
        """Leases of items this pass claimed but did not finish: free for any runner at once
        (if this fails, they expire after the lease)."""
        if not held:
            return
        try:
            await asyncio.to_thread(self.leases.release, set(held))
        except Exception as exc:
            log.warning("giving back batch item leases failed (they expire instead): %s", exc)

    async def _drain(
        self,
        batch_id: str,
        in_flight: set[asyncio.Task[None]],
        commits: set[asyncio.Task[None]],
        stop: Stop | None,
    ) -> Stop | None:
        """Wait for the items in flight, watching for a stop meanwhile. A stop cancels what is
        still in flight: a revoked key's items, and a cancelled or expired batch's (as OpenAI's
        batches do; an item may be waiting for a replica with backfill room, which interactive
        traffic can keep full for as long as it lasts, and the stop must not wait on that)."""
        while in_flight:
            await asyncio.wait(set(in_flight), timeout=_WATCH_S)
            if not in_flight:
                break
            now = await asyncio.to_thread(self._stop_reason, batch_id)
            if now is not None:
                await self._abandon(in_flight, commits)
                return now
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
