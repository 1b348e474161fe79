"""`KVCacheManager`: gives sequences the blocks they need, finds their cached prefixes, frees.

A full block is identified by a hash chained over its parent's hash and its own token ids, so
equal hashes mean equal prefixes. A sequence's cache salt (the gateway sets one per tenant) stands
in for the missing parent of its first block, so salted chains never meet unsalted ones or each
other: one tenant cannot learn from a cache hit what another tenant sent.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence as Seq

from modelyard.engine.block_pool import BlockPool, KVBlock
from modelyard.engine.sequence import Sequence


def hash_block(parent: bytes, token_ids: Seq[int]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def salt_root(salt: bytes) -> bytes:
    """The parent hash of a salted sequence's first block (an unsalted one has none: b"").

    A hash of its own domain (the personalisation), the same size as a block hash: a salt can
    never be chosen to equal some block's hash, so no salted first block hashes like any other
    block (every other parent is a block hash, or empty)."""
    if not salt:
        return b""
    return hashlib.blake2b(salt, digest_size=16, person=b"modelyard-salt").digest()


def salt_bytes(cache_salt: str | None) -> bytes:
    """A request's cache salt as the engine chains it (an adapter's requests add its own)."""
    return cache_salt.encode("utf-8") if cache_salt else b""


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _update_hashes(self, seq: Sequence) -> list[bytes]:
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[i - 1] if i else salt_root(seq.cache_salt)
            hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """The longest run of cached blocks that starts the sequence.

        At least one token is always left to compute, since its logits are needed to sample.
        """
        if not self.pool.enable_caching:
            return []
        hashes = self._update_hashes(seq)
        hit: list[KVBlock] = []
        for block_hash in hashes[: (seq.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(hit) * self.block_size
        return hit

    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if it cannot."""
        cached = cached or []
        have = len(seq.block_ids) + len(cached)
        total = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = blocks_for(total, self.block_size) - have
        # Cached blocks nobody holds sit in the free queue: taking them uses free capacity too.
        reclaimed = sum(1 for b in cached if b.ref_count == 0)
        if need + reclaimed > self.pool.num_free:
            return False
        for block in cached:
            self.pool.touch(block)
            seq.block_ids.append(block.block_id)
        for _ in range(max(need, 0)):
            seq.block_ids.append(self.pool.allocate().block_id)
        return True

    def commit(self, seq: Sequence) -> None:
        """Publish the sequence's newly full, computed blocks to the prefix cache."""
        if not self.pool.enable_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        if full <= seq.num_registered_blocks:
            return
        hashes = self._update_hashes(seq)
        for i in range(seq.num_registered_blocks, full):
            self.pool.register(self.pool.blocks[seq.block_ids[i]], hashes[i])
        seq.num_registered_blocks = full

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past the sequence's tokens (those a rejected draft took)."""
        keep = blocks_for(seq.num_tokens, self.block_size)
        while len(seq.block_ids) > keep:
            self.pool.release(self.pool.blocks[seq.block_ids.pop()])

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first, so its prefix is evicted last."""
        for block_id in reversed(seq.block_ids):
            self.pool.release(self.pool.blocks[block_id])
        seq.block_ids.clear()
        seq.num_registered_blocks = 0
