"""The local backend and the worker agree on the variable that ties a worker's life to its
platform's (the backend spells it out so that the control plane imports no torch)."""

from __future__ import annotations

from modelyard.control.backends import local
from modelyard.worker import server


def test_the_parent_pid_variable_is_the_one_the_worker_reads() -> None:
    assert local.PARENT_PID_ENV == server.PARENT_PID_ENV
