"""Settlements the limits store (Redis) could not take, journaled and applied to it exactly once
when it answers again.

While Redis does not answer, a request's settlement (its monthly quota moves, the release of its
concurrency slot) is added here instead: kept in memory, saved to the database (table
`limits_journal`) by the outage guard's next tick, so that a gateway that dies meanwhile leaves
it for another to apply. Each entry is applied by one Lua script that first checks two things:

- the Redis **epoch** (`EPOCH_KEY`, a random id written once into a Redis data set) is the one the
  gateway saw before the outage. A Redis that comes back with its data (the same server, or one
  restored from its AOF/RDB) has it and takes the entry; one that comes back empty has another
  (or none): its counters are rebuilt from the usage rows, which already hold the outage's
  usage, so the entry is dropped instead of counted a second time;
- the entry's **marker** (`MARKER_PREFIX` + its id, `SET NX`) is new: an entry applied by one
  gateway, or applied before its row could be removed (a crash between the two), is skipped.

So every journaled move reaches the counter once: never twice, and not lost while the database
or any one gateway keeps it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError

from modelyard.gateway.quota import (
    QUOTA_TTL_S,
    RedisConcurrencyLimiter,
    RedisQuotaCounter,
    shared_store,
)
from modelyard.store import limits_journal
from modelyard.store.db import Database

log = logging.getLogger(__name__)

# The Redis data set's identity: written once (SET NX) by the guard's heartbeat.
EPOCH_KEY = "modelyard:limits:epoch"
MARKER_PREFIX = "modelyard:limits:applied:"
# Entries read from the database per reconciliation.
PAGE = 1000

# KEYS: the epoch, the entry's marker, the quota counters of its two months (the second may
# repeat the first), the tenant's slots. ARGV: the entry's epoch, tokens of each month, the slot
# id ('' none), the quota ttl, the marker ttl. Returns 0 applied, 1 applied before, 2 another
# data set (nothing applied).
_APPLY_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 2
end
if not redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[6]) then
  return 1
end
for i = 3, 4 do
  local tokens = tonumber(ARGV[i - 1])
  if tokens ~= 0 then
    redis.call('INCRBY', KEYS[i], tokens)
    redis.call('EXPIRE', KEYS[i], ARGV[5])
  end
end
if ARGV[4] ~= '' then
  redis.call('ZREM', KEYS[5], ARGV[4])
end
return 0
"""


@dataclass(frozen=True)
class JournalEntry:
    """One settlement for the Redis data set `epoch`: quota moves `(month, tokens)` (at most
    two months, none zero) and the slot `(scope, slot id)` to release."""

    id: str
    tenant_id: str
    epoch: str
    moves: tuple[tuple[str, int], ...]
    slot: tuple[str, str] | None

    def row(self) -> dict[str, object]:
        change = {"moves": [list(m) for m in self.moves], "slot": self.slot and list(self.slot)}
        return {"id": self.id, "tenant_id": self.tenant_id, "epoch": self.epoch, "change": change}

    @classmethod
    def of_row(cls, row: dict[str, object]) -> JournalEntry:
        change = row["change"]
        assert isinstance(change, dict)
        slot = change.get("slot")
        return cls(
            id=str(row["id"]),
            tenant_id=str(row["tenant_id"]),
            epoch=str(row["epoch"]),
            moves=tuple((str(m), int(t)) for m, t in change.get("moves") or []),
            slot=(str(slot[0]), str(slot[1])) if slot else None,
        )


def net_moves(moves: list[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """Moves summed per month, zeros dropped, in first-seen order."""
    total: dict[str, int] = {}
    for month, tokens in moves:
        total[month] = total.get(month, 0) + tokens
    return tuple((m, t) for m, t in total.items() if t)


class SettlementJournal:
    """Settlements waiting for Redis (see the module's docstring)."""

    def __init__(
        self, db: Database, quota: RedisQuotaCounter, slots: RedisConcurrencyLimiter
    ) -> None:
        self.db = db
        self._quota, self._slots = quota, slots
        self._apply_script = quota.redis.register_script(_APPLY_LUA)
        self._unapplied: dict[str, JournalEntry] = {}  # added here, not applied yet
        self._unsaved: list[JournalEntry] = []  # added here, not in the database yet
        self.applied = 0  # entries this process applied (for logs and tests)

    def add(
        self,
        tenant_id: str,
        epoch: str,
        moves: list[tuple[str, int]],
        slot: tuple[str, str] | None,
    ) -> None:
        netted = net_moves(moves)
        if len(netted) > 2:
            raise ValueError(f"a settlement moves at most two months, not {netted}")
        if not netted and slot is None:
            return
        entry = JournalEntry(uuid.uuid4().hex, tenant_id, epoch, netted, slot)
        self._unapplied[entry.id] = entry
        self._unsaved.append(entry)

    @property
    def pending(self) -> int:
        """Entries this process added and has not applied yet."""
        return len(self._unapplied)

    async def save(self) -> None:
        """Entries added since the last save into the database; kept in memory if it fails."""
        if not self._unsaved:
            return
        batch, self._unsaved = self._unsaved, []
        try:
            await asyncio.to_thread(self._insert, [e.row() for e in batch])
        except SQLAlchemyError as exc:
            self._unsaved = batch + self._unsaved
            log.warning("saving %d limits journal entries failed (kept): %s", len(batch), exc)

    def _insert(self, rows: list[dict[str, object]]) -> None:
        with self.db.session() as s:
            limits_journal.add(s, rows)

    def _oldest(self) -> list[dict[str, object]]:
        with self.db.session() as s:
            return limits_journal.oldest(s, PAGE)

    def _remove(self, ids: list[str]) -> None:
        with self.db.session() as s:
            limits_journal.remove(s, ids)

    async def reconcile(self) -> int:
        """Apply every entry this process holds and a page of the database's (other gateways'
        too) to Redis, then forget them; the number applied now. Raises `LimitsUnavailable` if
        Redis fails meanwhile: what was applied stays marked, the rest waits for the next call."""
        await self.save()
        try:
            stored = [JournalEntry.of_row(r) for r in await asyncio.to_thread(self._oldest)]
        except SQLAlchemyError as exc:
            log.warning("reading the limits journal failed: %s", exc)
            stored = []
        entries = {e.id: e for e in stored} | self._unapplied
        done: list[str] = []
        applied = 0
        try:
            for entry in entries.values():
                outcome = await self._apply(entry)
                if outcome == 2:
                    log.warning(
                        "limits journal entry %s (tenant %s) is for another Redis data set: "
                        "dropped (that Redis is rebuilt from the usage rows)",
                        entry.id, entry.tenant_id,
                    )  # fmt: skip
                applied += outcome == 0
                done.append(entry.id)
        finally:
            finished = set(done)
            for entry_id in done:
                self._unapplied.pop(entry_id, None)
            self._unsaved = [e for e in self._unsaved if e.id not in finished]
            self.applied += applied
            if done:
                try:
                    await asyncio.to_thread(self._remove, done)
                except SQLAlchemyError as exc:  # applied and marked: removed on a later pass
                    log.warning("removing applied limits journal entries failed: %s", exc)
        return applied

    @shared_store
    async def _apply(self, e: JournalEntry) -> int:
        moves = list(e.moves) or [("-", 0)]  # a slot alone: no counter is touched
        if len(moves) == 1:
            moves.append((moves[0][0], 0))
        scope, slot_id = e.slot or ("-", "")
        result = await self._apply_script(
            keys=[
                EPOCH_KEY,
                MARKER_PREFIX + e.id,
                self._quota.key(e.tenant_id, moves[0][0]),
                self._quota.key(e.tenant_id, moves[1][0]),
                self._slots.key(scope),
            ],
            args=[e.epoch, moves[0][1], moves[1][1], slot_id, QUOTA_TTL_S, QUOTA_TTL_S],
        )
        return int(result)
