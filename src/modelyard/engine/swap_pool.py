"""`KVSwapPool`: a bounded set of KV blocks in host memory that keeps a preempted sequence's cache.

A sequence preempted by swap has its computed blocks copied here (`swap_out`) before its cache
blocks are freed for the more urgent sequence; when it resumes it gets fresh cache blocks and
the data is copied back (`swap_in`), so it goes on where it stopped, nothing recomputed. The pool
has the cache's layout per layer, `[2, blocks, block_size, kv_heads, head_dim]`, in the cache's
element type; on CPU it is an anonymous mapping like the cache (no memory is used until blocks
are swapped), on CUDA pinned host memory.

Copies run at once, in the engine's thread between two model steps: a swap-out has read the
victim's blocks before anyone can write them, and a swap-in has filled the resumed sequence's
blocks before the step that reads them runs. The pool's blocks are private to one sequence each
(no prefix sharing here): a block the victim shared through the prefix cache is copied too, so
the copy stays right whatever happens to the original.
"""

from __future__ import annotations

import time

import torch

from modelyard.engine.model_runner import allocate_kv_caches


class NoSwapSpaceError(RuntimeError):
    pass


class KVSwapPool:
    def __init__(self, kv_caches: list[torch.Tensor], num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV swap pool needs at least one block")
        first = kv_caches[0]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = first.device
        rest = tuple(first.shape[2:])  # kv_heads, head_dim
        self.bytes_per_block = 2 * block_size * first[0, 0].numel() * first.element_size()
        self.bytes_per_block *= len(kv_caches)
        self._caches = [c.view(2, -1, block_size, *rest) for c in kv_caches]
        shape = (2, num_blocks * block_size, *rest)
        if self.device.type == "cpu":
            host = allocate_kv_caches(shape, len(kv_caches), first.dtype, self.device)
        else:  # pinned: the copies go by DMA
            host = [torch.empty(shape, dtype=first.dtype, pin_memory=True) for _ in kv_caches]
        self._host = [h.view(2, num_blocks, block_size, *rest) for h in host]
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is taken first
        self.swapped_out_blocks = 0  # counters since start
        self.swapped_in_blocks = 0
        self.copy_seconds = 0.0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def swap_out(self, block_ids: list[int]) -> list[int]:
        """Copy these cache blocks into free pool blocks; their pool block ids, in order."""
        if len(block_ids) > len(self._free):
            raise NoSwapSpaceError(f"{len(block_ids)} blocks to swap, {len(self._free)} free")
        slots = [self._free.pop() for _ in block_ids]
        started = time.perf_counter()
        self._to_host(block_ids, slots)
        self.copy_seconds += time.perf_counter() - started
        self.swapped_out_blocks += len(block_ids)
        return slots

    def swap_in(self, slots: list[int], block_ids: list[int]) -> None:
        """Copy pool blocks `slots` into cache blocks `block_ids` and free the pool blocks."""
        started = time.perf_counter()
        self._to_cache(slots, block_ids)
        self.copy_seconds += time.perf_counter() - started
        self.swapped_in_blocks += len(slots)
        self.release(slots)

    def release(self, slots: list[int]) -> None:
        """Give pool blocks back unread (the swapped sequence finished or was aborted)."""
        self._free.extend(reversed(slots))

    def time_copy(self, num_blocks: int) -> float:
        """Seconds a swap of `num_blocks` blocks takes, out and back in, measured now on cache
        blocks 0.. (their contents are left as they were); counted in no counter."""
        n = min(num_blocks, self._caches[0].shape[1], len(self._free))
        if n < 1:
            return 0.0
        ids = list(range(n))
        slots = [self._free.pop() for _ in ids]
        started = time.perf_counter()
        self._to_host(ids, slots)
        self._to_cache(slots, ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        self.release(slots)
        return seconds

    @torch.inference_mode()
    def _to_host(self, block_ids: list[int], slots: list[int]) -> None:
        src = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        dst = torch.tensor(slots, dtype=torch.long)
        for cache, host in zip(self._caches, self._host, strict=True):
            host.index_copy_(1, dst, cache.index_select(1, src).cpu())

    @torch.inference_mode()
    def _to_cache(self, slots: list[int], block_ids: list[int]) -> None:
        src = torch.tensor(slots, dtype=torch.long)
        dst = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for cache, host in zip(self._caches, self._host, strict=True):
            cache.index_copy_(1, dst, host.index_select(1, src).to(self.device))
