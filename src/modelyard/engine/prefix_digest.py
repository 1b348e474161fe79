"""`PrefixDigest`: which of the gateway's prefix keys this engine's prefix cache holds.

The gateway keys a request's prompt by its rendered text, in blocks (`core/prefix_keys.py`), and
sends the keys with the request with, for each, how many of the prompt's tokens its text spans.
`note` ties each key to the KV block that ends at or before that token (its hash in the block
pool's prefix-cache index, chained from the request's cache salt as `KVCacheManager` chains it);
`held` lists the keys whose block the pool still holds — computed and not evicted — most recently
noted first. A key whose block was never computed (the request failed) or was evicted drops out
of the next list. At most `capacity` keys are remembered (least recently noted go first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from modelyard.engine.kv_cache_manager import KVCacheManager, hash_block, salt_root


class PrefixDigest:
    def __init__(self, kv: KVCacheManager, capacity: int) -> None:
        self.kv = kv
        self.capacity = capacity
        self.notes = 0  # requests noted: the digest's generation
        self._index: OrderedDict[bytes, bytes] = OrderedDict()  # key -> KV block hash

    def note(
        self, token_ids: Sequence[int], salt: bytes, keys: Sequence[bytes], ends: Sequence[int]
    ) -> None:
        """A request with these prompt tokens and cache salt carries `keys`, key i spanning the
        first `ends[i]` tokens."""
        bs = self.kv.block_size
        full = min(len(token_ids), max(ends, default=0)) // bs
        hashes: list[bytes] = []
        parent = salt_root(salt)
        for i in range(full):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        for key, end in zip(keys, ends, strict=True):
            block = min(end, len(token_ids)) // bs - 1
            if block < 0:
                continue
            self._index[key] = hashes[block]
            self._index.move_to_end(key)
        while len(self._index) > self.capacity:
            self._index.popitem(last=False)
        self.notes += 1

    def held(self, limit: int) -> list[bytes]:
        """Up to `limit` keys whose KV block is in the prefix cache, most recently noted first."""
        out: list[bytes] = []
        pool = self.kv.pool
        for key, block_hash in reversed(self._index.items()):
            if pool.lookup(block_hash) is not None:
                out.append(key)
                if len(out) == limit:
                    break
        return out
