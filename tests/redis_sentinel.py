"""Redis with Sentinel as real processes to break: a primary `redis-server`, a replica of it and
1-3 `redis-sentinel` processes watching them, on free ports in a temporary folder, with fast
failure detection (`down-after-milliseconds`, `failover-timeout`), all killed on `close()`.

    with SentinelRedis(sentinels=3) as r:
        env = {"MODELYARD_REDIS_URL": r.url}   # redis+sentinel://127.0.0.1:P1,.../modelyard
        r.kill_primary()
        r.wait_promoted()                      # a Sentinel names the replica, which is primary

`logs()` is every process's log, for a test to print when it fails (`printed_on_failure`).
The machine's shared Redis (6379) is never touched."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import pytest
import redis

from tests.conftest import free_port
from tests.waiting import wait_until

SERVICE = "modelyard"


def _sentinel_command() -> list[str]:
    """`redis-sentinel`, or `redis-server --sentinel` where only the server is installed."""
    if shutil.which("redis-sentinel"):
        return ["redis-sentinel"]
    return ["redis-server"]


class SentinelRedis:
    """A primary, its replica and `sentinels` Sentinels (see the module's docstring)."""

    def __init__(
        self, sentinels: int = 3, down_after_ms: int = 1000, failover_timeout_ms: int = 3000
    ) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        if not 1 <= sentinels <= 3:
            raise ValueError("1 to 3 Sentinels")
        self.dir = Path(tempfile.mkdtemp(prefix="modelyard-sentinel-"))
        self.primary_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def __enter__(self) -> SentinelRedis:
        try:
            self.start()
        except BaseException:
            print(self.logs())
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _server(self, name: str, port: int, *extra: str) -> None:
        work = self.dir / name
        work.mkdir()
        cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(work), "--logfile", str(self.dir / f"{name}.log"),
               *extra]  # fmt: skip
        self.procs[name] = subprocess.Popen(cmd)

    def start(self) -> None:
        self._server("primary", self.primary_port)
        self._server("replica", self.replica_port, "--replicaof", "127.0.0.1",
                     str(self.primary_port))  # fmt: skip
        wait_until(lambda: self._replication("replica").get("master_link_status") == "up",
                   "the replica to sync with the primary", timeout=30)  # fmt: skip
        quorum = len(self.sentinel_ports) // 2 + 1
        for i, port in enumerate(self.sentinel_ports):
            conf = self.dir / f"sentinel-{i}.conf"  # Sentinel rewrites it: its own file
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"logfile {self.dir / f'sentinel-{i}.log'}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} {quorum}\n"
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            cmd = [*_sentinel_command(), str(conf)]
            if cmd[0] == "redis-server":
                cmd.append("--sentinel")
            self.procs[f"sentinel-{i}"] = subprocess.Popen(cmd)
        # Every Sentinel has found the replica and the other Sentinels: a failover can start.
        for port in self.sentinel_ports:
            wait_until(lambda p=port: self._knows_all(p), f"Sentinel :{port} to see all",
                       timeout=30)  # fmt: skip

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)

    def _replication(self, name: str) -> dict[str, object]:
        port = self.primary_port if name == "primary" else self.replica_port
        with contextlib.suppress(redis.RedisError), self._client(port) as c:
            return dict(c.info("replication"))
        return {}

    def _knows_all(self, port: int) -> bool:
        with contextlib.suppress(redis.RedisError), self._client(port) as c:
            master = c.sentinel_master(SERVICE)
            return (
                int(master["num-slaves"]) >= 1
                and int(master["num-other-sentinels"]) == len(self.sentinel_ports) - 1
            )
        return False

    def kill_primary(self) -> None:
        proc = self.procs["primary"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def wait_promoted(self, timeout: float = 60.0) -> None:
        """Until every Sentinel names the replica and the replica says it is the primary."""

        def promoted() -> bool:
            every = all(self._named_by(p) == self.replica_port for p in self.sentinel_ports)
            return every and self._replication("replica").get("role") == "master"

        wait_until(promoted, "the Sentinels to promote the replica", timeout=timeout, interval=0.1)

    def _named_by(self, port: int) -> int | None:
        """The primary's port as this Sentinel tells clients: only once it no longer flags it
        down (a client asking in between gets no primary, as redis-py's discovery checks)."""
        with contextlib.suppress(redis.RedisError), self._client(port) as c:
            state = c.sentinel_master(SERVICE)
            if not state or not state.get("is_master") or state.get("is_sdown"):
                return None
            return None if state.get("is_odown") else int(state["port"])
        return None

    def logs(self) -> str:
        parts = []
        for log in sorted(self.dir.glob("*.log")):
            parts.append(f"----- {log.name} -----\n{log.read_text(errors='replace')[-20_000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def printed_on_failure(*logs: Callable[[], str]) -> Iterator[None]:
    """Print each process's log (a `logs`/`output` method) if the block fails."""
    try:
        yield
    except BaseException:
        for log in logs:
            with contextlib.suppress(Exception):
                print(log())
        raise
