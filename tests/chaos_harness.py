"""Real processes to break on purpose: a private `redis-server` and a private PostgreSQL cluster
(`initdb` + `pg_ctl`) on free ports, and a bounded traffic generator that records what every
request got, so chaos tests can check "usage rows == requests answered" afterwards.

The machine's shared services (5432, 6379) are never touched."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from tests.conftest import free_port

MESSAGES = [{"role": "user", "content": "Tell me a story about a fox"}]


def _binary(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


class RedisServer:
    """`redis-server` without persistence: a restart loses every counter, as a crash would."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="modelyard-chaos-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--dir", str(self.dir)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    @classmethod
    @contextmanager
    def running(cls) -> Iterator[RedisServer]:
        """A private server for the block (a test's own: it may kill and restart it)."""
        server = cls()
        server.start()
        try:
            yield server
        finally:
            server.close()


class PostgresServer:
    """A throwaway PostgreSQL cluster; as root its commands run as the `postgres` user."""

    def __init__(self) -> None:
        self.initdb, self.pg_ctl = _binary("initdb"), _binary("pg_ctl")
        if not self.initdb or not self.pg_ctl:
            pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="modelyard-chaos-pg-"))
        self.data = self.root / "data"
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self._run([self.initdb, "-D", str(self.data), "-U", "postgres", "-A", "trust",
                   "--no-sync", "-E", "UTF8"])  # fmt: skip

    def _run(self, cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if check and out.returncode != 0:
            raise RuntimeError(f"{cmd} failed: {out.stdout}{out.stderr}")
        return out

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        opts = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c max_connections=200")  # fmt: skip
        self._run([self.pg_ctl, "-D", str(self.data), "-l", str(self.root / "log"), "-w",
                   "-t", "60", "-o", opts, "start"])  # fmt: skip

    def kill(self) -> None:
        """An immediate shutdown: connections drop, no checkpoint (recovery at next start)."""
        self._run([self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop"],
                  check=False)  # fmt: skip

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class Outcome:
    request_id: str | None
    status: int | None  # None: no HTTP response at all
    complete: bool  # a whole answer reached the client
    stream: bool
    error: str | None = None
    seconds: float = 0.0
    retry_after: str | None = None
    ended: float = field(default_factory=time.monotonic)  # built when the request ended


def _error_of(r: httpx.Response) -> str:
    """The error code of an OpenAI-shaped error body, or `unclean: ...` if it is not one."""
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"unclean: {r.text[:200]!r}"


def send(
    base_url: str,
    key: str,
    model: str,
    stream: bool,
    max_tokens: int,
    timeout: float = 60.0,
    on_first_data: Callable[[], None] | None = None,
    on_done: Callable[[], None] | None = None,
) -> Outcome:
    """One chat request; never raises: what happened is in the outcome. A stream calls
    `on_first_data` once its first event has arrived (to inject a fault mid-answer), and
    `on_done` as soon as its `[DONE]` has (before reading the end of the response, as a
    client that stops at [DONE] would)."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "stream": stream,
            "ignore_eos": True}  # fmt: skip
    headers = {"authorization": f"Bearer {key}"}
    t0 = time.monotonic()
    request_id: str | None = None
    done = errored = False
    try:
        if not stream:
            r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers,
                           timeout=timeout)  # fmt: skip
            ok = r.status_code == 200 and bool(r.json().get("choices"))
            return Outcome(r.headers.get("x-request-id"), r.status_code, ok, False,
                           None if ok else _error_of(r), time.monotonic() - t0,
                           r.headers.get("retry-after"))  # fmt: skip
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                          headers=headers, timeout=timeout) as r:  # fmt: skip
            request_id = r.headers.get("x-request-id")
            if r.status_code != 200:
                r.read()
                return Outcome(request_id, r.status_code, False, True, _error_of(r),
                               time.monotonic() - t0, r.headers.get("retry-after"))  # fmt: skip
            for line in r.iter_lines():
                if on_first_data is not None and line.startswith("data: "):
                    on_first_data()
                    on_first_data = None
                if line == "data: [DONE]":
                    done = True
                    if on_done is not None:
                        on_done()
                elif line.startswith("data: ") and '"error"' in line[:20]:
                    errored = True
            return Outcome(request_id, 200, done and not errored, True,
                           "error event" if errored else None, time.monotonic() - t0)  # fmt: skip
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        if done and not errored:
            # The whole answer arrived (an SDK client stops reading at [DONE]), then the
            # connection was cut: answered, so it must be billed, but the cut is not clean.
            return Outcome(request_id, 200, True, stream, f"unclean: cut after [DONE]: {exc!r}",
                           time.monotonic() - t0)  # fmt: skip
        return Outcome(request_id, None, False, stream, repr(exc)[:200], time.monotonic() - t0)


class Traffic:
    """Bounded background load: `total` requests at most, `workers` at a time, 127.0.0.1 only,
    stopped early by `stop()` or after `max_seconds`."""

    def __init__(
        self,
        base_url: str,
        key: str,
        model: str,
        total: int = 60,
        workers: int = 3,
        max_tokens: int = 12,
        stream_every: int = 2,
        max_seconds: float = 90.0,
    ) -> None:
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._deadline = time.monotonic() + max_seconds
        self._pool = ThreadPoolExecutor(workers)
        self._futures = [
            self._pool.submit(self._one, base_url, key, model, i % stream_every == 0, max_tokens)
            for i in range(total)
        ]

    def _one(self, base_url: str, key: str, model: str, stream: bool, max_tokens: int) -> None:
        if self._stop.is_set() or time.monotonic() > self._deadline:
            return
        outcome = send(base_url, key, model, stream, max_tokens)
        with self._lock:
            self.outcomes.append(outcome)

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def wait_count(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.count() < n:
            assert time.monotonic() < deadline, f"only {self.count()} requests done"
            time.sleep(0.05)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for f in self._futures:
            f.result(timeout=180)
        self._pool.shutdown()
        return list(self.outcomes)

    def finish(self) -> list[Outcome]:
        """Let every request run (still bounded by max_seconds), then the outcomes."""
        for f in self._futures:
            f.result(timeout=180)
        self._pool.shutdown()
        return list(self.outcomes)


def check_usage(outcomes: list[Outcome], rows: list[dict[str, str]], killed: bool = False) -> None:
    """Every whole answer has exactly one `ok` usage row; nothing is billed twice or out of
    nowhere; a request the client saw fail is billed at most once, for what was generated.

    `killed`: the platform was SIGKILLed under this traffic. A row is journaled just before
    its answer leaves (gateway/accounting.py), so a request the kill cut off in that instant
    (no HTTP answer at all) may be billed `ok` though its client never read the answer; no
    other unanswered request may, and no more of those than the kill cut off."""
    ids = [r["request_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a request was billed twice"
    answered = {o.request_id for o in outcomes if o.complete}
    assert None not in answered
    sent = {o.request_id for o in outcomes if o.request_id}
    ok = {r["request_id"] for r in rows if r["status"] == "ok"}
    cut_off = {o.request_id for o in outcomes if o.status is None} if killed else set()
    # A request cut before any response byte (a non-streamed answer journaled, then the
    # kill before its headers left) never told its client its id: such rows are counted
    # against the number of those requests instead of matched by id.
    cut_off_unnamed = sum(1 for o in outcomes if o.status is None and not o.request_id)
    unexplained = ok - answered - cut_off
    assert answered <= ok and len(unexplained) <= (cut_off_unnamed if killed else 0), (
        f"answered but not billed: {sorted(answered - ok)}; billed ok but not answered: "
        f"{sorted(unexplained)} (requests cut off before their id was sent: {cut_off_unnamed})"
    )
    never_named = set(ids) - sent - answered
    assert len(never_named) <= (cut_off_unnamed if killed else 0), (
        f"rows for requests never sent: {never_named}"
    )


def assert_clean(outcomes: list[Outcome], allowed_statuses: set[int]) -> None:
    """No hang (every request returned within its timeout) and failures are HTTP errors in
    the OpenAI shape (or an error event in a stream), not dropped connections."""
    for o in outcomes:
        assert o.status is not None, f"no HTTP answer: {o}"
        assert not (o.error or "").startswith("unclean"), o
        assert o.complete or o.status in allowed_statuses or o.status == 200, o
