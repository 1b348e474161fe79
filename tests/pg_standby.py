"""A private PostgreSQL primary with a streaming standby, on free ports, to fail over on purpose.

`initdb` makes the primary, `pg_ctl` starts it, `pg_basebackup -R` copies it into a standby that
streams its WAL, and `fail_over()` does what an operator (or Patroni) does when the primary's
machine dies: the primary stops at once (`pg_ctl stop -m immediate`: no checkpoint, connections
cut) and the standby is promoted (`pg_ctl promote`); `rebuild_standby()` makes the dead one a
standby of the new primary, so that the pair can fail over once more. `url` is the libpq
multi-host URL with `target_session_attrs=read-write` that the platform is given, so new
connections find whichever of the two accepts writes.

Synchronous replication (`synchronous_standby_names = '*'`, the default here) is what makes a
commit the primary acknowledged survive the primary's immediate death: the commit returns only
once the standby has the WAL. The standby itself runs with no synchronous standby of its own, or
after its promotion every commit would wait forever for a standby that does not exist.

Nothing here needs pytest: `benchmarks/` can use it too. `logs()` is both servers' logs, for a
failed test to print. The machine's shared PostgreSQL (5432) is never touched."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

DATABASE = "modelyard"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def postgres_binary(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


def missing_binaries() -> str | None:
    """Why a standby pair cannot be made here, or None."""
    missing = [b for b in ("initdb", "pg_ctl", "pg_basebackup") if not postgres_binary(b)]
    return f"PostgreSQL server binaries not installed: {missing}" if missing else None


class StandbyPair:
    """A primary and its streaming standby, each a `pg_ctl` cluster under one temporary folder."""

    def __init__(self, synchronous: bool = True) -> None:
        reason = missing_binaries()
        if reason:
            raise RuntimeError(reason)
        self.synchronous = synchronous
        self.root = Path(tempfile.mkdtemp(prefix="modelyard-pg-standby-"))
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            shutil.chown(self.root, "postgres", "postgres")
        self.ports = {"primary": free_port(), "standby": free_port()}
        self.primary, self.standby = "primary", "standby"  # which cluster plays which part
        self.promote_s: float | None = None  # how long `pg_ctl promote -w` took

    # ----- commands ------------------------------------------------------------------------

    def _run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [postgres_binary(cmd[0]) or cmd[0], *cmd[1:]]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if check and out.returncode != 0:
            raise RuntimeError(f"{cmd} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
        return out

    def _data(self, name: str) -> str:
        return str(self.root / name)

    def _log(self, name: str) -> str:
        return str(self.root / f"{name}.log")

    def _conf(self, name: str, lines: list[str]) -> None:
        # Later lines of postgresql.conf win: the standby's overrides follow the copied ones.
        with open(Path(self._data(name)) / "postgresql.conf", "a") as f:
            f.write("\n".join(lines) + "\n")

    def _pg_ctl(self, name: str, *args: str, check: bool = True) -> None:
        self._run("pg_ctl", "-D", self._data(name), "-l", self._log(name), "-w", "-t", "60",
                  *args, check=check)  # fmt: skip

    def conninfo(self, name: str, dbname: str = DATABASE) -> str:
        return f"host=127.0.0.1 port={self.ports[name]} user=postgres dbname={dbname}"

    # ----- the pair ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The platform's `MODELYARD_DATABASE_URL`: both servers, the writable one wins."""
        hosts = ",".join(f"127.0.0.1:{self.ports[n]}" for n in ("primary", "standby"))
        return f"postgresql://postgres@{hosts}/{DATABASE}?target_session_attrs=read-write"

    def start(self) -> StandbyPair:
        self._run("initdb", "-D", self._data("primary"), "-U", "postgres", "-A", "trust",
                  "--no-sync", "-E", "UTF8")  # fmt: skip
        self._conf("primary", [
            f"port = {self.ports['primary']}",
            "listen_addresses = '127.0.0.1'",
            f"unix_socket_directories = '{self.root}'",
            "fsync = off",  # the tests kill processes, not the machine: the page cache survives
            "max_connections = 200",
            "wal_level = replica",
            "max_wal_senders = 5",
            "wal_sender_timeout = 5s",
            f"synchronous_standby_names = '{'*' if self.synchronous else ''}'",
        ])  # fmt: skip
        self._pg_ctl("primary", "start")
        self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.ports["primary"]),
                  "-U", "postgres", "-D", self._data("standby"), "-R", "-X", "stream",
                  "-c", "fast", "--no-sync")  # fmt: skip
        self._conf("standby", [
            f"port = {self.ports['standby']}",
            # No synchronous standby of its own: once promoted it is alone.
            "synchronous_standby_names = ''",
            "wal_receiver_status_interval = 1s",
        ])  # fmt: skip
        self._pg_ctl("standby", "start")
        self.wait_streaming()
        with psycopg.connect(self.conninfo("primary", "postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
        return self

    def wait_streaming(self, timeout: float = 60.0) -> None:
        """Until the primary streams to the standby (synchronously, when asked for)."""
        wanted = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.conninfo(self.primary, "postgres"), autocommit=True) as conn:
            while True:
                rows = conn.execute("SELECT state, sync_state FROM pg_stat_replication").fetchall()
                if ("streaming", wanted) in rows:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"standby not streaming ({wanted}): {rows}\n{self.logs()}")
                time.sleep(0.05)  # the poll's interval

    def fail_over(self, leaderless_s: float = 0.0) -> float:
        """Kill the primary at once, promote the standby `leaderless_s` later (the time a
        failover manager takes to decide: no server accepts writes meanwhile); the seconds the
        promotion itself took."""
        self._pg_ctl(self.primary, "-m", "immediate", "stop")
        time.sleep(leaderless_s)  # the outage lasts this long (a fault's length, not a wait)
        started = time.monotonic()
        self._pg_ctl(self.standby, "promote")
        self.promote_s = time.monotonic() - started
        self.primary, self.standby = self.standby, self.primary
        return self.promote_s

    def rebuild_standby(self) -> None:
        """Make the cluster `fail_over` stopped a standby of the new primary (a fresh
        `pg_basebackup`, as an operator rebuilds a failed primary), so that the pair can fail
        over again. Until it streams, the new primary commits alone; then synchronously again."""
        old = self.standby
        shutil.rmtree(self._data(old))
        self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.ports[self.primary]),
                  "-U", "postgres", "-D", self._data(old), "-R", "-X", "stream",
                  "-c", "fast", "--no-sync")  # fmt: skip
        self._conf(old, [f"port = {self.ports[old]}", "synchronous_standby_names = ''"])
        self._pg_ctl(old, "start")
        if self.synchronous:
            self._conf(self.primary, ["synchronous_standby_names = '*'"])
            self._run("pg_ctl", "-D", self._data(self.primary), "reload")
        self.wait_streaming()

    def in_recovery(self, name: str) -> bool:
        with psycopg.connect(self.conninfo(name), autocommit=True, connect_timeout=3) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])

    def query(self, name: str, sql: str) -> list[tuple]:
        """Rows of `sql` on one server, straight, not through the platform."""
        with psycopg.connect(self.conninfo(name), autocommit=True, connect_timeout=3) as conn:
            return conn.execute(sql).fetchall()

    def logs(self) -> str:
        out = []
        for name in ("primary", "standby"):
            path = Path(self._log(name))
            text = path.read_text(errors="replace") if path.exists() else "(no log)"
            out.append(f"----- PostgreSQL {name} on :{self.ports[name]} -----\n{text}")
        return "\n".join(out)

    def close(self) -> None:
        for name in ("primary", "standby"):
            if Path(self._data(name), "postmaster.pid").exists():
                self._pg_ctl(name, "-m", "immediate", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)
