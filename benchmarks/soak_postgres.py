"""PostgreSQL for a chaos soak: one server, or a primary and a streaming standby (`initdb`,
`pg_basebackup -R`, `pg_ctl promote`), each a `soak_topology.Proc` on a free port in a private
folder, killable (SIGKILL to the whole server) and restored as an operator's failover tool would."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from benchmarks.soak_topology import Proc, free_port, wait_for


def _pg_binary(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name) or ""]
    if not found[-1]:
        raise RuntimeError(f"PostgreSQL's {name} is not installed")
    return found[-1]


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


class PgNode(Proc):
    """One PostgreSQL server (`postgres -D`, in the foreground, so the supervisor holds its pid)."""

    def __init__(self, name: str, out: Path) -> None:
        super().__init__(name, out)
        self.port = free_port()
        # Its own folder outside the output dir, which the postgres user may not traverse.
        self.root = Path(tempfile.mkdtemp(prefix=f"modelyard-soak-{name}-"))
        self.data = self.root / "data"
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            self.user = "postgres"

    def run(self, cmd: list[str], timeout: float = 120.0) -> str:
        done = subprocess.run(_as_postgres(cmd), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def init_primary(self) -> None:
        self.run(
            [
                _pg_binary("initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
                "-E",
                "UTF8",
            ]
        )

    def init_standby_of(self, primary: PgNode) -> None:
        shutil.rmtree(self.data, ignore_errors=True)
        self.run(
            [
                _pg_binary("pg_basebackup"),
                "-h",
                "127.0.0.1",
                "-p",
                str(primary.port),
                "-U",
                "postgres",
                "-D",
                str(self.data),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
            ]
        )

    def command(self) -> list[str]:
        return [
            _pg_binary("postgres"),
            "-D",
            str(self.data),
            "-p",
            str(self.port),
            "-k",
            str(self.root),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "fsync=off",
            "-c",
            "max_connections=300",
            "-c",
            "wal_level=replica",
            "-c",
            "hot_standby=on",
            "-c",
            "max_wal_senders=10",
            "-c",
            "wal_keep_size=256MB",
        ]

    def query(self, sql: str) -> object:
        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            dbname="postgres",
            connect_timeout=2,
            autocommit=True,
        ) as conn:
            row = conn.execute(sql).fetchone()  # type: ignore[arg-type]
        return row[0] if row else None

    def is_primary(self) -> bool:
        return self.query("select pg_is_in_recovery()") is False

    def start(self, timeout: float = 60.0) -> None:
        self.launch()
        wait_for(lambda: self.query("select 1") == 1, f"{self.name} answering", timeout, 0.2)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def promote(self) -> None:
        self.run([_pg_binary("pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote"])


class PgTopology:
    """`single`: one server, restarted in place after a kill (crash recovery). `standby`: a
    primary and a streaming standby; a killed primary is replaced as an operator's failover
    tool would: the standby is promoted (`pg_ctl promote`), and the old primary is rebuilt as
    the new primary's standby (`pg_basebackup -R`). Clients reach whichever is primary through
    the multi-host URL (`target_session_attrs=read-write`)."""

    def __init__(
        self, mode: str, out: Path, promote_after_s: float = 2.0, restart_delay_s: float = 1.0
    ) -> None:
        self.promote_after_s = promote_after_s  # the failover tool's detection time
        self.restart_delay_s = restart_delay_s  # the supervisor's RestartSec (single)
        if mode not in ("single", "standby"):
            raise ValueError(f"--postgres {mode!r}: single or standby")
        self.mode = mode
        self.nodes = [PgNode("pg-a", out)]
        if mode == "standby":
            self.nodes.append(PgNode("pg-b", out))

    def procs(self) -> list[Proc]:
        return list(self.nodes)

    def start(self) -> None:
        self.nodes[0].init_primary()
        self.nodes[0].start()
        if self.mode == "standby":
            self.nodes[1].init_standby_of(self.nodes[0])
            self.nodes[1].start()

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        if self.mode == "single":
            return f"postgresql+psycopg://postgres@{hosts}/postgres"
        return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"

    def primary(self) -> PgNode:
        if self.mode == "single":
            return self.nodes[0]
        return next(n for n in self.nodes if n.alive and n.is_primary())

    def primary_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.primary().port}/postgres"

    def kill_primary(self) -> tuple[str, Callable[[], float]]:
        """SIGKILL the primary (its children die with it: the postmaster's death ends them);
        returns its name and a function that restores a writable primary (bounded), rebuilds
        the killed node as a standby where there is one, and answers kill-to-writable seconds."""
        victim = self.primary()
        killed_at = time.monotonic()
        victim.kill()

        def recover() -> float:
            if self.mode == "single":
                time.sleep(self.restart_delay_s)  # the supervisor's RestartSec
                victim.start()
                took = time.monotonic() - killed_at
                return took
            new = next(n for n in self.nodes if n is not victim)
            # The failover tool notices the primary is gone (its health checks' time).
            time.sleep(self.promote_after_s)
            new.promote()
            wait_for(new.is_primary, f"{new.name} promoted", 60, 0.2)
            took = time.monotonic() - killed_at
            # The old primary's orphaned backends may linger a moment holding its data dir.
            wait_for(
                lambda: (
                    not (victim.data / "postmaster.pid").exists() or _stale_pidfile(victim.data)
                ),
                "the old primary gone",
                30,
            )
            victim.init_standby_of(new)
            victim.start()
            return took

        return victim.name, recover


def _stale_pidfile(data: Path) -> bool:
    try:
        pid = int((data / "postmaster.pid").read_text().split()[0])
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, IndexError, ProcessLookupError):
        return True
    return False
