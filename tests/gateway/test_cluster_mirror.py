"""The shared routing table's rules, on a real PostgreSQL database without processes: a
gateway's mirror applies an entry only when its generation is newer, updates routes in place
(keeping each replica's in-flight count and breaker), and a tombstone removes the endpoint; the
store never replaces an entry with an older generation."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from modelyard.core.routing import RoutingTable
from modelyard.gateway.route_mirror import RouteMirror
from modelyard.store import routing_entries
from modelyard.store.db import Database
from tests.databases import fresh_postgres
from tests.waiting import async_wait_until


@pytest.fixture(scope="module")
def db() -> Iterator[Database]:
    with fresh_postgres() as url:
        database = Database(url)
        database.migrate()
        yield database
        database.dispose()


def entry(replicas: list[tuple[str, bool]], weights: dict[str, int] | None = None) -> dict:
    return {
        "endpoint_id": "ep-1",
        "tenant_id": "tn-1",
        "model_name": "tiny",
        "public": True,
        "version_id": "v1",
        "max_tokens_cap": 128,
        "upstream_model": None,
        "sampling_defaults": {"temperature": 0.2},
        "model_kind": "chat",
        "capabilities": {"tools": True, "max_context": 512},
        "weights": weights or {},
        "unavailable": None,
        "retry_after_s": 10,
        "replicas": [
            {
                "id": rid,
                "url": f"http://127.0.0.1:1/{rid}",
                "ready": ready,
                "max_concurrency": 4,
                "version_id": "v1",
                "pid": None,
            }
            for rid, ready in replicas
        ],
    }


def write(db: Database, generation: int, body: dict, removed: bool = False) -> None:
    with db.session() as s:
        routing_entries.write(s, body["endpoint_id"], generation, body, removed)
        routing_entries.notify(s, generation)


def test_newer_generations_apply_in_place_older_ones_never(db: Database) -> None:
    async def run() -> None:
        routing = RoutingTable()
        mirror = RouteMirror(db, routing)
        write(db, 5, entry([("rep-a", True)]))
        assert await mirror.refresh() == 1
        route = routing.resolve("tn-2", "tiny")
        assert route is not None and route.sampling_defaults == {"temperature": 0.2}
        # What the gateway checks a request's route against, and what /v1/models shows.
        assert (route.model_kind, route.capabilities["max_context"]) == ("chat", 512)
        replica_a = route.replicas[0]
        replica_a.outstanding = 2  # this gateway's requests in flight on it

        write(db, 6, entry([("rep-a", True), ("rep-b", True)], {"v1": 100}))
        assert await mirror.refresh() == 1
        assert routing.get("ep-1") is route  # the same route object: waiting requests see it
        assert [r.replica_id for r in route.replicas] == ["rep-a", "rep-b"]
        assert route.replicas[0] is replica_a and replica_a.outstanding == 2
        assert route.weights == {"v1": 100}

        write(db, 4, entry([]))  # an older generation: the store keeps the newer row
        assert await mirror.refresh() == 0
        assert len(route.replicas) == 2

        # A benched replica (refused a connection) is readmitted from its published readiness.
        RoutingTable.bench(replica_a)
        mirror.readmit_benched()
        assert replica_a.ready

        write(db, 7, {"endpoint_id": "ep-1"}, removed=True)
        assert await mirror.refresh() == 1
        assert routing.get("ep-1") is None

    asyncio.run(run())


def listening(db: Database) -> bool:
    """A session of the database is listening on the routes' channel (PostgreSQL says so)."""
    sql = text(
        "select count(*) from pg_stat_activity where datname = current_database() "
        "and query ilike :listen"
    )
    with db.session() as s:
        return bool(s.scalar(sql, {"listen": f"LISTEN {routing_entries.CHANNEL}%"}))


def test_notification_wakes_the_mirror(db: Database) -> None:
    async def run() -> None:
        routing = RoutingTable()
        mirror = RouteMirror(db, routing, refresh_s=60.0)  # the poll alone would take a minute
        await mirror.start()
        try:
            await async_wait_until(
                lambda: asyncio.to_thread(listening, db), "the mirror to LISTEN", 30
            )
            write(db, 100, entry([("rep-c", True)]))
            for _ in range(100):
                if routing.get("ep-1") is not None:
                    break
                await asyncio.sleep(0.05)
            route = routing.get("ep-1")
            assert route is not None and [r.replica_id for r in route.replicas] == ["rep-c"]
        finally:
            await mirror.stop()

    asyncio.run(run())
