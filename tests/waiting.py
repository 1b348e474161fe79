"""Waiting on observable state: `wait_until` polls a predicate until it holds (or fails the test
naming what never happened), so a test never sleeps a guessed time and hopes.

A fixed `time.sleep` is kept in tests only for the passage of time itself (a TTL or a lease
that must lapse, an idle connection, a fault that lasts a while, an absence watched for a while,
the pace of a load generator), each with a comment saying so; a sleep inside a polling loop
like these is the poll's interval."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], what: str, timeout: float = 60.0, interval: float = 0.05
) -> T:
    """The first truthy value of `predicate()`; an AssertionError naming `what` (and the last
    value seen) if none comes within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}: {value!r}")
        time.sleep(interval)


async def async_wait_until(
    predicate: Callable[[], T | Awaitable[T]],
    what: str,
    within_s: float = 60.0,
    interval: float = 0.02,
) -> T:
    """`wait_until` for a test on an event loop: the loop runs on while it polls, and the
    predicate may be a coroutine function (a look at Redis, say)."""
    timeout = within_s
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}: {value!r}")
        await asyncio.sleep(interval)
