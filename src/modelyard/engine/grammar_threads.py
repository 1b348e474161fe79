"""The grammar threads: where structured outputs' grammars are compiled and a request's fresh
matcher is probed, apart from the engine's thread and every event loop, each with a stack large
enough for the deepest grammar the worker's bounds allow."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

GRAMMAR_THREADS = 2
GRAMMAR_STACK_BYTES = 256 * 1024 * 1024  # address space; only what is used is committed
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def grammar_executor() -> ThreadPoolExecutor:
    """The grammar threads (created once, each with a large stack). Compiling a grammar and
    probing a request's fresh matcher on its first mask run here, never on the engine's thread
    or an event loop: llguidance compiles a grammar's chain of rules recursively, and a 48 kB
    Lark grammar of 2,800 chained rules overflows a default 8 MiB thread stack (the whole
    worker dies of SIGSEGV); the worker's spec bound (64 KiB) allows ~5,500 such rules, ~16 MiB
    of stack. Two threads: hostile grammars queue behind each other instead of taking every core
    from the engine."""
    global _executor
    with _executor_lock:
        if _executor is None:
            previous = threading.stack_size(GRAMMAR_STACK_BYTES)
            try:
                _executor = ThreadPoolExecutor(GRAMMAR_THREADS, "modelyard-grammar")
                # Threads start on submit, one per task that finds none idle: start them all
                # now, while the size is set (each task waits until every thread runs one).
                started = threading.Barrier(GRAMMAR_THREADS)
                futures = [_executor.submit(started.wait) for _ in range(GRAMMAR_THREADS)]
                for future in futures:
                    future.result()
            finally:
                threading.stack_size(previous)
        return _executor
