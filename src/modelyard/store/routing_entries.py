"""The shared routing table's rows (cluster mode): write an endpoint's entry with its
generation, read the entries newer than a generation, and the notification that one changed.

The leading controller is the only writer. A write and its notification are one transaction on
PostgreSQL (`pg_notify` is delivered at commit, in commit order), so a gateway that hears of a
generation always finds its row. An upsert never replaces a row with an older generation (a
leader that lost its lease but has not noticed yet cannot roll an entry back).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from modelyard.store.repository import now
from modelyard.store.tables import RoutingEntry

# PostgreSQL LISTEN/NOTIFY channel gateways listen on; the payload is the newest generation.
CHANNEL = "modelyard_routes"


def max_generation(s: Session) -> int:
    return int(s.scalar(select(func.max(RoutingEntry.generation))) or 0)


def write(
    s: Session, endpoint_id: str, generation: int, entry: dict[str, Any], removed: bool = False
) -> None:
    """Insert or replace `endpoint_id`'s entry unless the stored one is as new or newer."""
    if s.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    values = {
        "endpoint_id": endpoint_id,
        "generation": generation,
        "removed": removed,
        "entry": entry,
        "updated_at": now(),
    }
    stmt = insert(RoutingEntry).values(**values)
    stmt = stmt.on_conflict_do_update(
        index_elements=[RoutingEntry.endpoint_id],
        set_={k: stmt.excluded[k] for k in values if k != "endpoint_id"},
        where=RoutingEntry.generation < stmt.excluded.generation,
    )
    s.execute(stmt)


def notify(s: Session, generation: int) -> None:
    """Tell listening gateways (at this transaction's commit) that entries up to `generation`
    exist; a no-op off PostgreSQL."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_notify(:c, :g)"), {"c": CHANNEL, "g": str(generation)})


def newer_than(s: Session, generation: int) -> list[RoutingEntry]:
    """Entries written after `generation`, oldest first (0: every entry)."""
    stmt = select(RoutingEntry).where(RoutingEntry.generation > generation)
    return list(s.scalars(stmt.order_by(RoutingEntry.generation)))
