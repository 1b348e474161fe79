"""Usage metering: one record per request id, written in the background, never twice.

The gateway hands each finished request to `UsageRecorder.claim` and then `write`. `claim`
says whether the request id is new and how the tenant's monthly token counter moves (from the
tokens reserved at admission to the real count; the gateway makes the move in its one
settlement of the limits store, so quota checks see it at once). `write` appends the
row to this process's usage journal on local disk (one write, before the gateway sends the
answer: see `usage_journal.py`, so a SIGKILL right after answering loses nothing) and queues it
for a writer task, which inserts rows in batches with `ON CONFLICT (request_id) DO NOTHING`,
so a retried, duplicated or replayed record cannot bill twice. A failed write is retried with
backoff and the rows are kept (in memory and in the journal); `stop()` flushes what is left.
`recover()` at start replays the journals of processes that died before their rows were
committed.

Settling a served request must not depend on its client staying connected: the gateway runs
it in a task of the recorder's (`settle`), which a disconnect cannot cancel and `stop()` awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy.exc import InterfaceError, OperationalError

from modelyard.gateway.quota import month_of
from modelyard.gateway.usage_journal import UsageJournal
from modelyard.store import repository as repo
from modelyard.store.db import Database

log = logging.getLogger(__name__)

_SEEN_CAPACITY = 100_000
T = TypeVar("T")


@dataclass
class UsageEvent:
    request_id: str
    tenant_id: str
    key_id: str
    endpoint_id: str | None
    model: str
    version_id: str | None
    kind: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    latency_ms: float
    ttft_ms: float | None
    status_code: int
    status: str
    batch: bool = False
    created_at: datetime = field(default_factory=repo.now)
    cost_micro: int | None = None  # micro-dollars at the model's price (`core/pricing.py`)
    team_id: str | None = None
    adapter: str | None = None  # the tenant's registry adapter, `name:version`

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def quota_moves(reserved: int, held_in: str, used: int, month: str) -> list[tuple[str, int]]:
    """The moves, `(month, tokens)`, of a tenant's quota counters that settle a request from
    the `reserved` tokens it held in month `held_in` to the `used` tokens it is billed in
    `month` (two moves when it was admitted in one month and finished in the next)."""
    moves = []
    if held_in != month:
        if reserved:
            moves.append((held_in, -reserved))
        reserved = 0
    if used != reserved:
        moves.append((month, used - reserved))
    return moves


class UsageRecorder:
    def __init__(
        self,
        db: Database,
        flush_interval_s: float = 0.05,
        journal: UsageJournal | None = None,
    ) -> None:
        self.db = db
        self.flush_interval_s = flush_interval_s
        self.journal = journal  # None: rows wait only in memory until written (tests)
        self._pending: list[dict[str, Any]] = []
        # One flush at a time: a reader's flush (the usage export) must wait for a batch the
        # background writer has taken off the queue but not yet committed, or it reads without it.
        self._flushing = asyncio.Lock()
        # Recent request ids, so a duplicate report does not count twice against the quota
        # either; the table's unique key is what guarantees one row.
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._settling: set[asyncio.Task[Any]] = set()
        self.written = 0

    async def recover(self) -> None:
        """Bill what processes that died left in their journals (before quotas are seeded)."""
        if self.journal is not None:
            await asyncio.to_thread(self.journal.replay, self._insert)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-writer")

    def settle(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run a request's settlement (limits, quota, its usage record) in a task of its own:
        awaited through `asyncio.shield`, a client's disconnect cancels the wait, not the work.
        `stop()` waits for the ones still running."""
        task = asyncio.create_task(work, name="usage-settle")
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return task

    def claim(
        self, event: UsageEvent, reserved: int = 0, reserved_month: str | None = None
    ) -> tuple[bool, list[tuple[str, int]]]:
        """Whether this is the request's first report (a duplicate, e.g. a retry, bills
        nothing), and the moves of the tenant's quota counter, `(month, tokens)`, that settle
        it from the `reserved` tokens held since admission (in `reserved_month`, default the
        event's) to its real count; a duplicate only gives its reservation back."""
        month = month_of(event.created_at)
        held_in = reserved_month or month
        if event.request_id in self._seen:
            return False, [(held_in, -reserved)] if reserved else []
        self._seen[event.request_id] = None
        if len(self._seen) > _SEEN_CAPACITY:
            self._seen.popitem(last=False)
        return True, quota_moves(reserved, held_in, event.total_tokens, month)

    async def write(self, event: UsageEvent) -> None:
        """Journal a claimed request's row and queue it for the background writer. When this
        returns the row survives the process's death, so the gateway calls it before the answer
        (or the stream's end) leaves."""
        row = dict(vars(event))  # its fields are scalars: a shallow copy, unlike asdict's deep one
        if self.journal is not None:
            self.journal.append(row)
        self._pending.append(row)
        if len(self._pending) >= 256:
            self._wake.set()
        if self.journal is not None and self.journal.fsync:
            # Off the event loop; the row is queued already, so the file is not emptied under
            # it before it is committed.
            await asyncio.to_thread(self.journal.sync)

    def _insert(self, rows: list[dict[str, Any]]) -> int:
        with self.db.session() as s:
            return repo.insert_usage(s, rows)

    async def flush(self) -> None:
        """Write every queued row; when this returns, every row recorded before the call is
        committed (also those another flush had in flight)."""
        async with self._flushing:
            while self._pending:
                batch, self._pending = self._pending[:1000], self._pending[1000:]
                try:
                    self.written += await asyncio.to_thread(self._insert, batch)
                except Exception:
                    self._pending = batch + self._pending
                    raise
            # Nothing queued and no batch in flight: every journaled row is committed.
            if self.journal is not None:
                self.journal.committed()

    async def _run(self) -> None:
        backoff = self.flush_interval_s
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=backoff)
            self._wake.clear()
            try:
                await self.flush()
                if backoff > self.flush_interval_s:
                    log.warning("usage records are written again")
                backoff = self.flush_interval_s
            except (OperationalError, InterfaceError) as exc:
                # The database is down: one warning per outage, not a traceback per retry.
                if backoff == self.flush_interval_s:
                    log.warning("writing usage records failed (kept, retrying): %s", exc)
                backoff = min(backoff * 2, 5.0)
            except Exception:
                log.exception("writing usage records failed; keeping them and retrying")
                backoff = min(backoff * 2, 5.0)

    async def stop(self) -> None:
        while self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        try:
            await self.flush()
        except Exception:
            if self.journal is not None:
                self.journal.close(remove=False)  # the next start replays it
            raise
        if self.journal is not None:
            self.journal.close(remove=True)
