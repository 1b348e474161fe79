"""Core counting: how many CPU cores this process may run on, and each tensor-parallel rank's
share of them."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(tp_size: int) -> int:
    """CPU ranks split the cores this process may use between them."""
    return max(1, usable_cores() // tp_size)
