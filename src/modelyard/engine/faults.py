"""What a failed engine step means: a request that failed alone, or an engine that is done.

A step that raises is first blamed on its requests (each is retried alone, and only those
that fail again are failed). Some errors leave the process itself in doubt: the allocator
ran out (`MemoryError`) or the CUDA context is poisoned (an illegal access or a device-side
assert make every later kernel fail). Those are fatal: the worker exits and is replaced.
"""

from __future__ import annotations

import torch

# After this many steps in a row in which every request failed, the engine is presumed broken.
MAX_CONSECUTIVE_FAILED_STEPS = 5

_CUDA_MARKERS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert")


class RequestFailed(RuntimeError):
    """A request failed inside an engine step; the engine itself kept serving."""


class RequestInvalid(RequestFailed):
    """A request failed in a step through its own constraints (its grammar broke or allows no
    token): the client's fault, answered as a 400. Neither the engine nor the replica is in
    doubt, so it counts toward no failed-step streak and no replica's circuit breaker."""


class EngineFatalError(RuntimeError):
    """The engine cannot go on; the process should exit so that it is replaced."""


def is_fatal(exc: BaseException) -> bool:
    """True for errors after which no later step can be trusted."""
    if isinstance(exc, MemoryError | EngineFatalError):
        return True
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False  # the failed step's tensors are freed as it unwinds
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _CUDA_MARKERS)
