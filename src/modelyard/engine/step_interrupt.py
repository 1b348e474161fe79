"""`StepInterrupt`: a step of batch work alone stops between two decoder layers when a real-time
request arrives, so that request waits for one layer of the step in flight, not the whole step.

A step cannot be split once it runs, and on a CPU even one row costs the whole model's weight
reads (~10 ms for SmolLM2-135M on 2 cores): a real-time request arriving during a step of batch
work alone waited for it all, which was the whole of backfill's TTFT cost at the worker. Such a
step is *armed*: a request of a real-time class raises the flag (`request`, from the event
loop's thread), and the model checks it before each decoder layer (Python's layer loop, or the
one-call C decode step through `my_step.stop`), raising `StepInterrupted`. The engine then
drops the step: nothing was sampled or committed, and the KV slots written so far are the ones
the same step writes again with the same values when it runs next (see `LLMEngine._forward`),
so the batch sequences' outputs equal an uninterrupted run. What is lost is the part of one
step already computed.

Steps with any real-time row are never armed, and neither are tensor-parallel steps (every rank
would have to stop at the same layer) or steps on an accelerator (where a step is short and
launched ahead). The flag is cleared before the engine takes in new requests, so a request that
arrives between two steps costs no interruption: it is in the next step's plan.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager


class StepInterrupted(Exception):
    """The armed step stopped between two layers for a real-time arrival."""


class StepInterrupt:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._flag = ctypes.c_int32(0)
        self._armed = False
        self.count = 0  # steps stopped

    def request(self) -> None:
        """A real-time request is waiting (any thread): stop the armed step, if one runs."""
        self._flag.value = 1

    def clear(self) -> None:
        """Before the engine takes in new requests: what arrived by now is in the next plan."""
        self._flag.value = 0

    @contextmanager
    def arming(self, on: bool) -> Iterator[None]:
        """The step run inside may be interrupted (if `on` and this engine allows it)."""
        self._armed = on and self.enabled
        try:
            yield
        except StepInterrupted:
            self.count += 1
            raise
        finally:
            self._armed = False

    def check(self) -> None:
        """Between two layers: raise `StepInterrupted` if the armed step is to stop."""
        if self._armed and self._flag.value:
            raise StepInterrupted

    def address(self) -> int:
        """The flag's address for a C step that checks it (0, C's NULL, when not armed)."""
        return ctypes.addressof(self._flag) if self._armed else 0
