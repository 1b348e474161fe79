"""A chaos soak, the platform's availability figure: a whole cluster under steady mixed load while
one piece is SIGKILLed every `--kill-every` seconds in rotation, for `--duration` seconds.

Topology: 2 `modelyard controller`s (one leads), 2 `modelyard gateway`s, local worker replicas
(2) of a tiny random-weight Llama (runs on 2 CPU cores), Redis (`--redis single`: one node;
`sentinel`: primary + replica + Sentinel, `redis+sentinel://` URL) and PostgreSQL (`--postgres
single`: one server; `standby`: primary + streaming standby, multi-host URL with
`target_session_attrs=read-write`). Load: `--clients` threads with the `openai` SDK (default
retries) over both gateways, chat (streamed and not), completions and embeddings (a tiny
embedding model on the encoder host; `--no-embeddings` leaves them out), plus a batch every
`--batch-every` seconds.

Kills in rotation (`--kill worker,gateway,leader,redis,postgres`): a worker replica, a gateway
(alternating), the leading controller, the Redis primary, the PostgreSQL primary. An operator's
supervisor is simulated: a killed (or crashed) gateway or controller is restarted on the same
address after `--restart-delay` seconds (systemd `Restart=always`); a killed Redis primary is
failed over by the Sentinel and restarted as a replica; a killed PostgreSQL primary is replaced
by promoting the standby (`pg_ctl promote` after `--pg-promote-after` seconds, as a failover
tool would) and rebuilt as its standby; with `single`, Redis or PostgreSQL is restarted in place
after `--restart-delay` (PostgreSQL with crash recovery). Worker replicas are replaced by the
leader itself.

It reports requests sent / succeeded / failed with a retryable status / lost, usage rows against
answered request ids (exactly once), batch items lost or duplicated, each kill's recovery time,
and availability = succeeded / sent. JSON to `<out>/report.json` (and `--json`), a summary on
stdout; every process's log is kept in `<out>/logs/` and its tail printed on failure.

    python benchmarks/chaos_soak.py                                   # 10 min, full rotation
    python benchmarks/chaos_soak.py --redis single --postgres single \\
        --kill worker,gateway,leader --duration 120 --kill-every 20   # what main has today
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.soak_checks import Batches, exactly_once, metering
from benchmarks.soak_cluster import SoakCluster
from benchmarks.soak_load import Load, tally

PIECES = ("worker", "gateway", "leader", "redis", "postgres")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (600)")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills (30)")
    p.add_argument("--kill", default=",".join(PIECES), help="the rotation, comma-separated")
    p.add_argument("--redis", choices=("single", "sentinel"), default="sentinel")
    p.add_argument("--postgres", choices=("single", "standby"), default="standby")
    p.add_argument("--clients", type=int, default=4, help="SDK client threads (4)")
    p.add_argument("--rate", type=float, default=8.0, help="requests/s offered in all (8)")
    p.add_argument("--replicas", type=int, default=2, help="worker replicas of the model (2)")
    p.add_argument(
        "--embeddings",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="embeddings in the mix (a tiny embedding model on the encoder host)",
    )
    p.add_argument("--batch-items", type=int, default=10, help="items per batch (10; 0: none)")
    p.add_argument("--batch-every", type=float, default=45.0, help="seconds between batches")
    p.add_argument("--restart-delay", type=float, default=1.0, help="supervisor's RestartSec")
    p.add_argument(
        "--pg-promote-after",
        type=float,
        default=2.0,
        help="seconds the PostgreSQL failover tool takes to promote the standby (2)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="the SDK's request timeout (s)")
    p.add_argument("--out", type=Path, default=None, help="output dir (logs, report.json)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    args.kill = [k for k in args.kill.split(",") if k]
    unknown = set(args.kill) - set(PIECES)
    if unknown:
        p.error(f"--kill: unknown {sorted(unknown)}; choose from {','.join(PIECES)}")
    return args


def chaos_loop(cluster: SoakCluster, args: argparse.Namespace, started: float) -> list[dict]:
    """Kill one piece every `kill_every` seconds in rotation until `duration` is over."""
    kills: list[dict[str, Any]] = []
    end = started + args.duration
    next_at = started + args.kill_every
    i = 0
    while args.kill and next_at < end:
        time.sleep(max(0.0, next_at - time.monotonic()))  # the schedule of the faults
        piece = args.kill[i % len(args.kill)]
        record: dict[str, Any] = {"piece": piece, "at_s": round(time.monotonic() - started, 1)}
        try:
            record.update(cluster.kill(piece, round_no=i))
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"[{record['at_s']:7.1f}s] killed {piece}: {record}", flush=True)
        kills.append(record)
        i += 1
        next_at = max(next_at + args.kill_every, time.monotonic())
    time.sleep(max(0.0, end - time.monotonic()))  # the rest of the run's load
    return kills


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out or Path(tempfile.mkdtemp(prefix="modelyard-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    cluster = SoakCluster(
        out,
        args.redis,
        args.postgres,
        secrets.token_hex(32),
        args.restart_delay,
        args.pg_promote_after,
    )
    failed = True
    try:
        t_setup = time.monotonic()
        cluster.start(replicas=args.replicas, embeddings=args.embeddings)
        setup_s = time.monotonic() - t_setup
        print(f"cluster up in {setup_s:.1f}s: {cluster.describe()}", flush=True)
        load = Load(
            cluster.gateway_urls,
            cluster.key,
            cluster.model,
            args.clients,
            args.rate,
            args.timeout,
            cluster.embed_model,
        )
        batches = Batches(
            cluster.sdk(cluster.key), args.batch_items, args.batch_every, cluster.model
        )
        started = time.monotonic()
        cluster.supervisor.epoch = started
        load.start()
        batches.start()
        kills = chaos_loop(cluster, args, started)
        batches.stop()
        outcomes = load.stop()
        print(f"load stopped after {time.monotonic() - started:.0f}s; settling", flush=True)
        cluster.all_up()
        batch_report = batches.settle(timeout=240)
        rows = cluster.wait_metered(
            [o.request_id for o in outcomes if o.ok and o.request_id], timeout=120
        )
        meter = metering(outcomes, rows, batch_report.pop("item_request_ids"))
        counts = tally(outcomes)
        report = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "benchmarks/chaos_soak.py " + " ".join(sys.argv[1:]),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "topology": cluster.describe(),
            "client": "openai SDK, max_retries=2 (default), timeout "
            f"{args.timeout:g}s; each client has a home gateway and fails over to the "
            "other only on a refused connection (nothing sent)",
            "supervisor": "killed/crashed gateways and controllers restarted on the same "
            f"address after {args.restart_delay:g}s; Redis and PostgreSQL primaries "
            "failed over (sentinel / pg_ctl promote) or restarted in place (single)",
            "requests": counts,
            "availability_pct": round(100.0 * counts["succeeded"] / max(1, counts["sent"]), 4),
            "client_failovers": load.failovers,
            "metering": meter,
            "metered_exactly_once": exactly_once(meter),
            "batches": batch_report,
            "kills": kills,
            "unplanned_exits": cluster.supervisor.unplanned,
            "restarts": cluster.supervisor.restarts,
            "loop_stalls": cluster.loop_stalls(),
            "setup_s": round(setup_s, 1),
            "out_dir": str(out),
        }
        failed = False
        return report
    finally:
        if failed:
            print(cluster.logs_tail(), file=sys.stderr)
        cluster.close()


def summary(r: dict[str, Any]) -> str:
    q, m, b = r["requests"], r["metering"], r["batches"]
    lines = [
        f"chaos soak {r['date']}: {r['config']['duration']:g}s, kill every "
        f"{r['config']['kill_every']:g}s ({','.join(r['config']['kill'])}); {r['topology']}",
        f"requests: sent {q['sent']}, succeeded {q['succeeded']}, failed with a retryable "
        f"status {q['failed_retryable_status']}, lost {q['lost']} "
        f"(streams cut mid-answer {q['lost_mid_stream']}; "
        f"SDK retries {q['sdk_retries']},"
        f" client failovers {r['client_failovers']})",
        f"availability: {r['availability_pct']:.4f} %",
        f"metering: {m['answered']} answered, {m['usage_rows']} rows; unmetered "
        f"{m['answered_unmetered']}, metered twice {m['metered_twice']}, ok rows without an "
        f"answer {m['ok_rows_without_answer']} (unexplained {m['ok_rows_unexplained']}): "
        f"{'exactly once' if r['metered_exactly_once'] else 'NOT exactly once'}",
        f"batches: {b['submitted']} submitted, {b['items_expected']} items, lost "
        f"{b['items_lost']}, duplicated {b['items_duplicated']}, failed {b['items_failed']}, "
        f"unfinished {len(b['unfinished'])}; batch rows {m['batch_usage_rows']}",
        "kills:",
        *(
            f"  {k['at_s']:7.1f}s {k['piece']:9s} {k.get('target', '')}: "
            + (
                f"recovered in {k['recovery_s']:.2f}s ({k.get('means', '')})"
                if "recovery_s" in k
                else f"ERROR {k.get('error')}"
            )
            for k in r["kills"]
        ),
        f"unplanned exits: {r['unplanned_exits'] or 'none'}; loop stalls: {r['loop_stalls']}",
    ]
    if q["errors"]:
        lines.append("failures: " + json.dumps(q["errors"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2)
    Path(report["out_dir"], "report.json").write_text(text)
    if args.json:
        args.json.write_text(text)
    print(summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
