"""Real processes for a chaos soak, each startable, killable and restartable on the same address
with its log kept in one output folder: Redis (one node, or a primary, a replica and a Sentinel)
and the cluster's roles (`modelyard gateway` / `modelyard controller`); PostgreSQL is in
`soak_postgres.py`.

Every wait is bounded (`wait_for`). The machine's shared services (5432, 6379) are never touched:
every server here is private, on a free port, in a folder under the output dir."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

import httpx
import redis

T = TypeVar("T")
SENTINEL_SERVICE = "modelyard"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], T], what: str, timeout: float, interval: float = 0.1) -> T:
    """The first truthy value of `predicate()` (exceptions count as falsy); TimeoutError naming
    `what` past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
        except Exception as exc:
            value, last = None, exc  # type: ignore[assignment]
        else:
            last = value
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}: {last!r}")
        time.sleep(interval)


class Proc:
    """One long-lived process, its output appended to `<out>/logs/<name>.log` across restarts."""

    def __init__(self, name: str, out: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = out / "logs" / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.popen: subprocess.Popen[bytes] | None = None
        self._log: IO[str] | None = None
        self.starts = 0
        self.user: str | None = None  # run as this user (PostgreSQL refuses to run as root)

    def command(self) -> list[str]:
        raise NotImplementedError

    def launch(self) -> None:
        if self._log is None:
            self._log = self.log_path.open("a")
        self.starts += 1
        self._log.write(f"\n===== start {self.starts} at {time.strftime('%H:%M:%S')}\n")
        self._log.flush()
        self.popen = subprocess.Popen(
            self.command(),
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            user=self.user,
            group=self.user,
            extra_groups=[] if self.user else None,
            start_new_session=True,  # its own process group: a kill takes its children too
        )

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> None:
        """Signal the process group (a machine's loss: a server's children die with it; local
        workers a controller started live in sessions of their own and are not touched)."""
        if self.popen is None or self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""


# ----- Redis -----------------------------------------------------------------------------------


class RedisNode(Proc):
    """`redis-server` without persistence (a restart loses what it held, as a crash would)."""

    def __init__(self, name: str, out: Path, replica_of: int | None = None) -> None:
        super().__init__(name, out)
        self.port = free_port()
        self.dir = out / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.replica_of = replica_of

    def command(self) -> list[str]:
        cmd = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
        ]
        if self.replica_of is not None:
            cmd += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        return cmd

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)

    def ping(self) -> bool:
        c = self.client()
        try:
            return bool(c.ping())
        finally:
            c.close()

    def start(self, timeout: float = 20.0) -> None:
        self.launch()
        wait_for(self.ping, f"{self.name} answering", timeout)


class Sentinel(Proc):
    """One `redis-server --sentinel` watching the primary (quorum 1, down after 3 s).

    Not 1 s: with one sentinel and quorum 1, a primary that misses one second of pings is
    failed over. On a loaded 2-core machine that happened to the primary just promoted, a
    second after the failover (the sentinel's first pings to it went unanswered for 1 s while
    both cores ran tests); the old primary, just back as its replica, was promoted over it, and
    a write made to the new primary in between never reached the other node (test_chaos_soak,
    2026-12-06). A kill is still detected within 3 s."""

    def __init__(self, name: str, out: Path, primary_port: int) -> None:
        super().__init__(name, out)
        self.port = free_port()
        self.conf = out / f"{name}.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {out}\n"
            f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {primary_port} 1\n"
            f"sentinel down-after-milliseconds {SENTINEL_SERVICE} 3000\n"
            f"sentinel failover-timeout {SENTINEL_SERVICE} 5000\n"
            f"sentinel parallel-syncs {SENTINEL_SERVICE} 1\n"
        )

    def command(self) -> list[str]:
        return ["redis-server", str(self.conf), "--sentinel"]

    def primary_port(self) -> int | None:
        c = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
        try:
            addr = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_SERVICE)
        finally:
            c.close()
        return int(addr[1]) if addr else None

    def start(self, timeout: float = 20.0) -> None:
        self.launch()
        wait_for(self.primary_port, f"{self.name} knowing the primary", timeout)


class RedisTopology:
    """`single`: one node, restarted in place after a kill. `sentinel`: a primary, a replica and
    a Sentinel; a killed primary is failed over by the Sentinel, and the supervisor restarts it
    only once the Sentinel has promoted the replica (the Sentinel then makes it a replica)."""

    def __init__(self, mode: str, out: Path, restart_delay_s: float = 1.0) -> None:
        self.restart_delay_s = restart_delay_s  # the supervisor's RestartSec
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed")
        self.mode = mode
        self.nodes = [RedisNode("redis-a", out)]
        self.sentinel: Sentinel | None = None
        if mode == "sentinel":
            self.nodes.append(RedisNode("redis-b", out, replica_of=self.nodes[0].port))
            self.sentinel = Sentinel("sentinel", out, self.nodes[0].port)
        elif mode != "single":
            raise ValueError(f"--redis {mode!r}: single or sentinel")

    def procs(self) -> list[Proc]:
        return [*self.nodes, *([self.sentinel] if self.sentinel else [])]

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        if self.sentinel is not None:
            wait_for(
                lambda: (
                    self.nodes[1].client().info("replication").get("master_link_status") == "up"
                ),
                "the Redis replica in sync",
                30,
            )
            self.sentinel.start()

    @property
    def url(self) -> str:
        if self.sentinel is None:
            return f"redis://127.0.0.1:{self.nodes[0].port}/0"
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{SENTINEL_SERVICE}/0"

    def primary(self) -> RedisNode:
        if self.sentinel is None:
            return self.nodes[0]
        port = self.sentinel.primary_port()
        return next(n for n in self.nodes if n.port == port)

    def client(self) -> redis.Redis:
        return self.primary().client()

    def kill_primary(self) -> tuple[str, Callable[[], float]]:
        """SIGKILL the primary; returns its name and a function that waits (bounded) until
        writes succeed again (on the promoted replica with Sentinel), restarts the killed node
        as a supervisor would, and answers the seconds from the kill to writable."""
        victim = self.primary()
        killed_at = time.monotonic()
        victim.kill()

        def recover() -> float:
            if self.sentinel is None:
                time.sleep(self.restart_delay_s)  # the supervisor's RestartSec
                victim.start()
                wait_for(lambda: victim.client().set("soak:probe", "1"), "Redis writable", 60)
                return time.monotonic() - killed_at
            new = wait_for(
                lambda: self.sentinel.primary_port() not in (None, victim.port) and self.primary(),
                "the Sentinel promoting the replica",
                60,
            )
            wait_for(lambda: new.client().set("soak:probe", "1"), "the new primary writable", 30)
            took = time.monotonic() - killed_at
            victim.replica_of = new.port  # back as a replica, as the Sentinel would make it
            victim.start()
            return took

        return victim.name, recover


# ----- the cluster's roles ---------------------------------------------------------------------


class RoleNode(Proc):
    """`modelyard gateway` or `modelyard controller` on a fixed port (a restart comes back on the
    same address, as a supervised service does)."""

    def __init__(self, name: str, role: str, out: Path, data_dir: Path, env: dict[str, str]):
        super().__init__(name, out, env)
        self.role = role
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "modelyard.cli",
            self.role,
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--log-level",
            "info",
        ]

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self, timeout: float = 120.0) -> None:
        self.launch()
        self.wait_up(timeout)

    def wait_up(self, timeout: float = 120.0) -> None:
        def up() -> bool:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            return self.healthy()

        deadline = time.monotonic() + timeout
        while not up():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not come up:\n{self.tail()}")
            time.sleep(0.2)
