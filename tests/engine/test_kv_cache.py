"""Block pool and KV cache manager: allocation, reference counts, prefix hits, LRU eviction."""

from __future__ import annotations

import pytest

from modelyard.engine.block_pool import BlockPool, NoFreeBlocksError
from modelyard.engine.kv_cache_manager import KVCacheManager, hash_block, salt_root
from modelyard.engine.sampling_params import SamplingParams
from modelyard.engine.sequence import Sequence


def make_seq(tokens: list[int], seq_id: int = 0, salt: bytes = b"") -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=str(seq_id),
        index=0,
        prompt_len=len(tokens),
        token_ids=list(tokens),
        params=SamplingParams(),
        cache_salt=salt,
    )


def compute(kv: KVCacheManager, seq: Sequence, n: int) -> None:
    """What a step does after the model ran: count the tokens and publish full blocks."""
    seq.num_computed_tokens += n
    kv.commit(seq)


def test_blocks_are_allocated_on_demand_and_freed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert kv.allocate(seq, 10)
    assert len(seq.block_ids) == 3  # ceil(10 / 4)
    compute(kv, seq, 10)
    seq.token_ids.append(99)
    assert kv.allocate(seq, 1)  # position 10 still fits in block 3
    assert len(seq.block_ids) == 3
    compute(kv, seq, 1)
    seq.token_ids.append(98)
    assert kv.allocate(seq, 1)
    compute(kv, seq, 1)
    seq.token_ids.append(97)
    assert kv.allocate(seq, 1)  # position 12 needs a fourth block
    assert len(seq.block_ids) == 4
    assert kv.pool.num_free == 4
    kv.free(seq)
    assert kv.pool.num_free == 8 and seq.block_ids == []


def test_allocation_fails_without_side_effects_when_full() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_seq(list(range(8)))
    assert kv.allocate(a, 8)
    b = make_seq(list(range(100, 104)), seq_id=1)
    assert not kv.allocate(b, 4)
    assert b.block_ids == [] and kv.pool.num_free == 0


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 13))  # exactly 3 full blocks
    a = make_seq(prompt)
    assert kv.find_cached_prefix(a) == []
    assert kv.allocate(a, len(prompt))
    compute(kv, a, len(prompt))

    b = make_seq(prompt, seq_id=1)
    hit = kv.find_cached_prefix(b)
    # Same 12 tokens, but the last one must be recomputed for its logits: 2 blocks, not 3.
    assert [blk.block_id for blk in hit] == a.block_ids[:2]
    assert kv.allocate(b, 4, hit)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert kv.pool.blocks[a.block_ids[0]].ref_count == 2

    c = make_seq([*prompt, 50, 51], seq_id=2)  # longer prompt: all 3 blocks hit
    assert len(kv.find_cached_prefix(c)) == 3


def test_hash_is_chained_and_salted() -> None:
    root = hash_block(b"", [1, 2, 3, 4])
    assert hash_block(b"", [1, 2, 3, 4]) == root
    assert hash_block(root, [5, 6, 7, 8]) != hash_block(b"", [5, 6, 7, 8])
    assert salt_root(b"") == b""  # no salt: the hashes of before, at no cost
    salted = salt_root(b"tenant-a")
    assert len(salted) == len(root) and salted not in (root, salt_root(b"tenant-b"))
    assert hash_block(salted, [1, 2, 3, 4]) != root


def _cached_blocks(kv: KVCacheManager, tokens: list[int], salt: bytes, seq_id: int) -> int:
    """Blocks of `tokens` the prefix cache serves under `salt`; then computes and publishes
    them, as a step would."""
    seq = make_seq(tokens, seq_id, salt)
    hit = kv.find_cached_prefix(seq)
    assert kv.allocate(seq, len(tokens) - len(hit) * kv.block_size, hit)
    compute(kv, seq, len(tokens) - seq.num_computed_tokens)
    return len(hit)


def test_cache_salts_keep_prefixes_apart() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4)
    prompt = list(range(1, 18))  # 4 full blocks and one token
    assert _cached_blocks(kv, prompt, b"tenant-a", 0) == 0
    # The same salt shares, as unsalted requests always did: every full block hits.
    assert _cached_blocks(kv, prompt, b"tenant-a", 1) == 4
    # Another salt, or none, sees nothing of tenant-a's blocks (not even the first)...
    assert _cached_blocks(kv, prompt, b"tenant-b", 2) == 0
    assert _cached_blocks(kv, prompt, b"", 3) == 0
    # ...and each now has its own namespace that shares within itself.
    assert _cached_blocks(kv, prompt, b"tenant-b", 4) == 4
    assert _cached_blocks(kv, prompt, b"", 5) == 4
    # A salt equal to a block hash is no way into the unsalted chain: the salt is hashed
    # into its own domain first, so a salted first block never hashes like a later one.
    first = hash_block(b"", prompt[:4])
    assert _cached_blocks(kv, prompt[4:], first, 6) == 0


def test_different_prefix_same_block_tokens_do_not_hit() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.allocate(a, 9)
    compute(kv, a, 9)
    b = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], seq_id=1)
    assert kv.find_cached_prefix(b) == []


def test_freed_cached_blocks_are_reused_then_evicted_lru() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    kv.allocate(a, 5)
    compute(kv, a, 5)
    kv.free(a)
    assert kv.pool.num_free == 4 and kv.pool.num_cached == 2

    again = make_seq([1, 2, 3, 4, 9], seq_id=1)
    assert len(kv.find_cached_prefix(again)) == 2  # freed blocks still serve hits

    # A new unrelated sequence takes the never-cached block first, then evicts the LRU tail:
    # the second block of `a` (freed first) goes before its first block.
    other = make_seq([7, 7, 7, 7, 7, 7], seq_id=2)
    assert kv.allocate(other, 6)
    assert kv.pool.num_cached == 1
    survivor = kv.find_cached_prefix(make_seq([1, 2, 3], seq_id=3))
    assert len(survivor) == 1


def test_reclaiming_free_cached_blocks_counts_against_capacity() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    kv.allocate(a, 5)
    compute(kv, a, 5)
    kv.free(a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8], seq_id=1)
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 2
    assert not kv.allocate(b, 4, hit)  # 2 reclaimed + 2 new > 3 free
    assert all(blk.ref_count == 0 for blk in hit) and b.block_ids == []


def test_pool_refuses_double_release_and_empty_allocation() -> None:
    pool = BlockPool(1)
    block = pool.allocate()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    pool.release(block)
    with pytest.raises(AssertionError):
        pool.release(block)
