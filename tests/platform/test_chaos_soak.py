"""The chaos soak's short version (`benchmarks/chaos_soak.py`, 2 minutes): 2 controllers, 2
gateways, 2 worker replicas of a tiny model on private PostgreSQL and Redis servers, under
steady load from `openai` SDK clients (default retries) over both gateways, with a worker, a
gateway and the leading controller SIGKILLed in rotation every 20 s, each restarted as a
supervisor would. The pieces on main only: one Redis, one PostgreSQL, no embeddings (the full
rotation, Redis primary and PostgreSQL primary included, needs Sentinel support and multi-host
PostgreSQL URLs: `--redis sentinel --postgres standby`; embeddings need a takeover that keeps
the encoder host). The second test checks that full rotation's harness alone.

Asserted:
- every kill recovered (a replacement replica ready, the gateway back, a standby leading);
- every answered request id has exactly one usage row, no logical request is metered twice, and
  an `ok` row without an answer exists only for an attempt whose response never reached its
  client (a connection a kill cut after the row was journaled), at most one per such attempt;
- nothing lost after the SDK's retries, except streams already sending tokens when their worker
  or gateway was killed (never re-sent after the first byte, by design): at most one per client
  per such kill; no request ends on a retryable status;
- no batch item lost, duplicated, failed or unmetered; no process exited unasked; no event loop
  stalled.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import psycopg
import pytest

from benchmarks import chaos_soak
from benchmarks.soak_postgres import PgNode, PgTopology
from benchmarks.soak_topology import RedisTopology
from tests.databases import skip_or_fail
from tests.waiting import wait_until

# Cluster start (~35 s), 120 s of load, settling and teardown on 2 vCPU.
pytestmark = pytest.mark.timeout(480)

CLIENTS = 4


def _logs(out: Path, chars: int = 4000) -> str:
    """Every process's log (tail): servers and roles, the replicas the controllers started (in
    their shared data dir) and the loop-stall log, for a failure's report."""
    replicas = sorted((out / "control" / "logs").glob("*.log"))
    logs = [*sorted((out / "logs").glob("*.log")), *replicas, out / "loop_stalls.jsonl"]
    return "\n".join(
        f"===== {log.name}\n{log.read_text(errors='replace')[-chars:]}"
        for log in logs
        if log.exists()
    )


def _need_servers() -> None:
    for binary in ("redis-server", "initdb", "pg_basebackup"):
        found = shutil.which(binary) or list(Path("/usr/lib/postgresql").glob(f"*/bin/{binary}"))
        if not found:
            skip_or_fail(f"{binary} is not installed")


def test_soak_topology_fails_over_redis_and_postgres(tmp_path: Path) -> None:
    """The soak's full-rotation harness, without the platform: a killed Redis primary is
    replaced by its replica through the Sentinel, and comes back as the replica; a killed
    PostgreSQL primary by its promoted standby, rebuilt as the new standby; what was written
    before each kill is still there, and the multi-host URL reaches the new primary."""
    _need_servers()
    redis_topo = RedisTopology("sentinel", tmp_path)
    pg = PgTopology("standby", tmp_path, promote_after_s=0)
    try:
        redis_topo.start()
        pg.start()
        for round_no in range(2):
            _fail_over_redis(redis_topo, f"before-{round_no}")
            _fail_over_postgres(pg, round_no)
    except Exception:
        for proc in [*redis_topo.procs(), *pg.procs()]:
            print(f"===== {proc.name}\n{proc.tail()}")
        raise
    finally:
        for proc in [*redis_topo.procs(), *pg.procs()]:
            proc.kill()
        for node in pg.nodes:
            node.remove()


def _fail_over_redis(topo: RedisTopology, key: str) -> None:
    first = topo.primary()
    replica = next(n for n in topo.nodes if n is not first)
    first.client().set(key, "1")
    wait_until(lambda: replica.client().get(key), "the write replicated", timeout=30)
    topo.kill_primary()[1]()
    assert topo.primary() is replica and replica.client().get(key) == b"1"
    wait_until(lambda: first.client().info("replication")["role"] == "slave",
               "the old primary back as a replica", timeout=30)  # fmt: skip


def _rows(node: PgNode) -> object:
    """The check table's row count on `node`; None before the table has replicated there."""
    try:
        return node.query("select count(*) from soak_check")
    except psycopg.errors.UndefinedTable:
        return None


def _fail_over_postgres(pg: PgTopology, round_no: int) -> None:
    old = pg.primary()
    standby = next(n for n in pg.nodes if n is not old)
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute("create table if not exists soak_check (n int)")
        conn.execute("insert into soak_check values (%s)", (round_no,))
    wait_until(lambda: _rows(standby) == round_no + 1, "the standby caught up", timeout=30)
    pg.kill_primary()[1]()
    assert pg.primary() is standby and old.query("select pg_is_in_recovery()") is True
    with psycopg.connect(pg.url, autocommit=True) as conn:
        assert conn.info.port == standby.port
        assert conn.execute("select count(*) from soak_check").fetchone() == (round_no + 1,)


def test_short_chaos_soak_loses_and_double_bills_nothing(tmp_path: Path, cache_dir: Path) -> None:
    _need_servers()
    out = tmp_path / "soak"
    args = chaos_soak.parse_args([
        "--duration", "120", "--kill-every", "20", "--kill", "worker,gateway,leader",
        "--redis", "single", "--postgres", "single", "--clients", str(CLIENTS),
        "--batch-every", "30", "--out", str(out),
        # Not yet: each new leader restarts the shared encoder host, and embeddings answer
        # 404 model_not_found meanwhile (issue 30, item 5); drop this once it is adopted.
        "--no-embeddings",
    ])  # fmt: skip
    report = chaos_soak.run(args)
    print(chaos_soak.summary(report))
    try:
        _check(report)
    except AssertionError:
        print(_logs(out))
        raise


def _check(report: dict) -> None:
    kills, q, m, b = report["kills"], report["requests"], report["metering"], report["batches"]
    assert [k["piece"] for k in kills] == ["worker", "gateway", "leader", "worker", "gateway"]
    assert all("recovery_s" in k for k in kills), kills
    # Exactly once.
    assert m["answered"] == q["succeeded"] and m["answered_without_id"] == 0, m
    assert m["answered_unmetered"] == 0 and m["answered_metered_not_ok"] == 0, m
    assert m["duplicate_row_ids"] == 0 and m["metered_twice"] == 0, m
    assert m["ok_rows_unexplained"] == 0, m
    assert report["metered_exactly_once"], m
    # Nothing lost after the client's retries, but streams cut mid-answer by a kill.
    cutting_kills = sum(1 for k in kills if k["piece"] in ("worker", "gateway"))
    assert q["failed_retryable_status"] == 0, q["errors"]
    assert q["lost"] == q["lost_mid_stream"] <= CLIENTS * cutting_kills, q["errors"]
    assert q["sent"] >= 100, q
    # Batches.
    assert b["submitted"] >= 3 and not b["submit_errors"] and not b["unfinished"], b
    assert b["items_expected"] == b["submitted"] * b["items_per_batch"], b
    assert b["items_lost"] == b["items_duplicated"] == b["items_failed"] == 0, b
    assert m["batch_usage_rows"] == b["items_expected"], m
    assert m["batch_items_unmetered"] == m["batch_rows_without_item"] == 0, m
    # The processes.
    assert report["unplanned_exits"] == [], report["unplanned_exits"]
    assert report["loop_stalls"] == 0, report["loop_stalls"]
