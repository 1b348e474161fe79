"""`PrefixDigest`: the gateway's prefix keys tied to the KV blocks that hold their tokens, reported
while the prefix cache holds those blocks — through the real `KVCacheManager` (allocate, commit,
free, evict), as a step does it."""

from __future__ import annotations

from modelyard.engine.kv_cache_manager import KVCacheManager, salt_bytes
from modelyard.engine.prefix_digest import PrefixDigest
from tests.engine.test_kv_cache import compute, make_seq

KEYS = [b"key-one!", b"key-two!", b"key-3333"]


def served(kv: KVCacheManager, tokens: list[int], salt: str, seq_id: int = 0) -> None:
    """A request computed in full, then finished (its blocks stay cached, free)."""
    seq = make_seq(tokens, seq_id, salt_bytes(salt))
    assert kv.allocate(seq, len(tokens))
    compute(kv, seq, len(tokens))
    kv.free(seq)


def test_keys_are_held_while_their_blocks_are_cached() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    digest = PrefixDigest(kv, capacity=16)
    tokens = list(range(100, 114))  # 3 full blocks and 2 tokens
    # Noted before the prompt is computed: nothing is cached yet, so nothing is reported.
    digest.note(tokens, salt_bytes("tenant-a"), KEYS, [4, 9, 14])
    assert digest.held(10) == [] and digest.notes == 1
    served(kv, tokens, "tenant-a")
    assert digest.held(10) == KEYS[::-1]  # most recently noted first
    assert digest.held(2) == KEYS[:0:-1]  # bounded
    # Another tenant's salt chains other blocks: the same tokens are not its cache.
    other = PrefixDigest(kv, capacity=16)
    other.note(tokens, salt_bytes("tenant-b"), KEYS, [4, 9, 14])
    assert other.held(10) == []
    # A key spanning less than one block has none; the index keeps at most `capacity` keys.
    small = PrefixDigest(kv, capacity=2)
    small.note(tokens, salt_bytes("tenant-a"), [b"short!!!", *KEYS], [3, 4, 9, 14])
    assert small.held(10) == KEYS[:0:-1]
    # Evicted blocks (tail first: `free` releases a sequence's blocks that way) drop their keys.
    served(kv, [7] * 16, "tenant-c", seq_id=1)  # two free blocks, then two cached ones
    assert digest.held(10) == [KEYS[0]]
