"""The limits journal's rows: settlements Redis could not take, added while it was away, read
oldest first and removed once applied (`gateway/settlement_journal.py` does the applying)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from modelyard.store.repository import now
from modelyard.store.tables import LimitsJournalEntry


def add(s: Session, rows: Iterable[dict[str, Any]]) -> None:
    """Insert entries (`id`, `tenant_id`, `epoch`, `change`); an id already there is kept."""
    for row in rows:
        if s.get(LimitsJournalEntry, row["id"]) is None:
            s.add(LimitsJournalEntry(created_at=now(), **row))


def oldest(s: Session, limit: int) -> list[dict[str, Any]]:
    """Up to `limit` entries, oldest first, as plain dicts."""
    stmt = select(LimitsJournalEntry).order_by(LimitsJournalEntry.created_at).limit(limit)
    return [
        {"id": e.id, "tenant_id": e.tenant_id, "epoch": e.epoch, "change": e.change}
        for e in s.scalars(stmt)
    ]


def remove(s: Session, ids: Iterable[str]) -> None:
    wanted = list(ids)
    if wanted:
        s.execute(delete(LimitsJournalEntry).where(LimitsJournalEntry.id.in_(wanted)))
