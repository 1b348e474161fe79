"""What the endpoint view shows of each replica's load (`replicas.items[].load_progress`).

Copying the model files into this node's cache is the control plane's own work: the node cache
reads the store through `CountingStore`, which counts the bytes read for the fetch in progress
(a contextvar, carried by `asyncio.to_thread` into the copying thread) against the endpoint's
meter. Once the worker runs it reports its own phases in the file beside its log
(`core.load_progress`); the view reads that file when asked, so nothing polls it.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from modelyard.control.state import EndpointState, Replica
from modelyard.core.load_progress import (
    READY,
    LoadPhase,
    LoadProgress,
    copying,
    progress_file_beside,
    read_progress,
)
from modelyard.core.status import ReplicaState

_COPIED: ContextVar[Callable[[int], None] | None] = ContextVar("copied", default=None)
# An endpoint's model files being copied in: [bytes done, bytes total].
_meters: weakref.WeakKeyDictionary[EndpointState, list[int]] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def copy_meter(state: EndpointState, total_bytes: int) -> Iterator[None]:
    """Count what the node cache reads inside the block as `state`'s files being copied."""
    meter = [0, total_bytes]
    _meters[state] = meter

    def add(n: int) -> None:
        meter[0] += n

    token = _COPIED.set(add)
    try:
        yield
    finally:
        _COPIED.reset(token)
        if _meters.get(state) is meter:
            del _meters[state]


class _CountingReader:
    def __init__(self, reader: Any, add: Callable[[int], None]) -> None:
        self._reader = reader
        self._add = add

    def read(self, size: int = -1) -> bytes:
        block: bytes = self._reader.read(size)
        self._add(len(block))
        return block

    def close(self) -> None:
        self._reader.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


class CountingStore:
    """The artifact store, its blob readers counting bytes for the current `copy_meter`."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def open(self, sha256: str) -> Any:
        reader = self._store.open(sha256)
        add = _COPIED.get()
        return reader if add is None else _CountingReader(reader, add)


def replica_load_progress(state: EndpointState, replica: Replica) -> dict[str, Any] | None:
    """`{phase, fraction}` (and bytes while copying) of a replica; None once it failed or
    stopped, or before anything is known of its start."""
    if replica.state in (ReplicaState.READY, ReplicaState.UNHEALTHY, ReplicaState.DRAINING):
        return READY.view()
    if replica.state is not ReplicaState.STARTING:
        return None
    handle = replica.handle
    if handle is not None:
        reported = read_progress(progress_file_beside(handle.log_path)) if handle.log_path else None
        if reported is None or reported.at < replica.started_at - 1:  # an older run's file
            reported = LoadProgress(LoadPhase.LOADING, 0.0, at=time.time())
        return reported.view()
    meter = _meters.get(state)
    if meter is not None:
        return copying(meter[0], meter[1]).view()
    return None
