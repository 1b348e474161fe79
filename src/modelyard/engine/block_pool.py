"""`BlockPool`: the fixed set of KV cache blocks, their reference counts and the prefix-cache index.

A block whose reference count drops to zero goes to the free queue but keeps its contents and
its hash, so a later request with the same prefix can take it back (a prefix-cache hit). New
blocks are taken from the front of the queue: blocks holding nothing reusable first, then the
least recently freed cached blocks (LRU eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks held by running sequences (free cached blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self) -> KVBlock:
        if not self._free:
            raise NoFreeBlocksError("no free KV cache blocks")
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            self._cached.pop(block.block_hash, None)
            block.block_hash = None
        block.ref_count = 1
        return block

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, block: KVBlock) -> None:
        """Take one more reference to a block found in the prefix cache."""
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def release(self, block: KVBlock) -> None:
        block.ref_count -= 1
        if block.ref_count < 0:
            raise AssertionError(f"block {block.block_id} released more often than taken")
        if block.ref_count == 0:
            self._free[block.block_id] = block
            if block.block_hash is None:
                # Nothing to reuse in it: hand it out before any cached block.
                self._free.move_to_end(block.block_id, last=False)

    def register(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a full, computed block under its prefix hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already published; this one stays private
        block.block_hash = block_hash
        self._cached[block_hash] = block
