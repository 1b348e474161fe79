"""A replica's idle-owner watchdog: a replica no controller has heard from for too long exits.

In cluster mode replicas outlive their controller on purpose (a standby that takes over adopts
them), so nothing ties them to a process that could die with them. Instead the leading
controller sends each replica it owns a heartbeat (`PUT /admin/owner`, with the worker token)
every third of a lease (`control/owner_heartbeat.py`), and a replica started with
`MODELYARD_OWNER_TIMEOUT_S` (the `replica_owner_leases` setting times `controller_lease_s`)
that hears none for that long shuts itself down and exits with `ORPHANED_EXIT_CODE`: every
controller stopped, or none leads for that long, and no replica keeps its model in memory with
no owner. A standby that takes over adopts the replicas and resumes the heartbeats well within
that time. A replica started without the variable (`serve`, which ties its replicas to itself
with a parent-death signal, or a worker started by hand) has no watchdog.

The clock runs on a thread of its own (the event loop only stores a timestamp per heartbeat),
and starts when the replica starts serving: loading a model takes no heartbeat.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modelyard.config import PlatformSettings

log = logging.getLogger(__name__)

OWNER_TIMEOUT_ENV = "MODELYARD_OWNER_TIMEOUT_S"
HEARTBEAT_PATH = "/admin/owner"
# The exit code of a replica that shut itself down for want of an owner (the Ray host then
# removes its actor, `control/backends/ray_host.py`).
ORPHANED_EXIT_CODE = 4
# After the graceful shutdown was asked for, how long before a hard exit.
_HARD_EXIT_S = 15.0


def owner_timeout_s(settings: PlatformSettings) -> float | None:
    """How long a detached replica waits for its owner's heartbeat (None: forever)."""
    if settings.replica_owner_leases <= 0:
        return None
    return settings.replica_owner_leases * settings.controller_lease_s


def heartbeat_interval_s(settings: PlatformSettings) -> float:
    """How often the leader heartbeats its replicas: every third of a lease."""
    return settings.controller_lease_s / 3


def configured_timeout() -> float | None:
    """This replica's timeout, from the environment its platform gave it (None: no watchdog)."""
    raw = os.environ.get(OWNER_TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        log.warning("ignoring %s=%r: not a number", OWNER_TIMEOUT_ENV, raw)
        return None
    return value if value > 0 else None


class OwnerWatch:
    """Stops this process's server (`server.should_exit`: its graceful shutdown; a hard exit if
    that hangs) when no heartbeat came for `timeout_s`; `orphaned` then says so, for the exit
    code. Without a server set, SIGTERM to itself."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.orphaned = False
        self.server: Any = None  # the uvicorn.Server, set once built
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def heard(self) -> None:
        """A heartbeat from the owner (called on the event loop: one store)."""
        self._last = time.monotonic()

    @property
    def silent_s(self) -> float:
        return time.monotonic() - self._last

    def start(self) -> None:
        """Start the clock (when the replica starts serving)."""
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="owner-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            if self.silent_s > self.timeout_s:
                self._orphaned()
                return

    def _orphaned(self) -> None:
        self.orphaned = True
        log.error(
            "no controller has sent this replica a heartbeat for %.0fs (timeout %gs): every "
            "controller is gone or none leads; the replica exits",
            self.silent_s,
            self.timeout_s,
        )
        hard_exit = threading.Timer(_HARD_EXIT_S, os._exit, (ORPHANED_EXIT_CODE,))
        hard_exit.daemon = True
        hard_exit.start()
        if self.server is not None:
            # Not a signal: uvicorn raises a caught signal again on its way out, which would
            # hide the exit code.
            self.server.should_exit = True
        else:
            os.kill(os.getpid(), signal.SIGTERM)


def exit_if_orphaned(watch: OwnerWatch | None) -> None:
    """After the server stopped: exit with `ORPHANED_EXIT_CODE` if the watchdog stopped it."""
    if watch is not None and watch.orphaned:
        raise SystemExit(ORPHANED_EXIT_CODE)
