"""Tensor parallelism: one model spread over several ranks (processes, one per device) of a node.

Rank 0 is the ordinary engine process: scheduler, KV cache manager, sampler, detokenizer and
whatever serves it. Its `leader.TensorParallelLeader` starts ranks 1..N-1 as helper processes
(`python -m modelyard.engine.tensor_parallel.helper`), watches them, and before every forward
pass broadcasts the step's inputs in the format of `wire`. Helpers load only their shard of the
weights (see `models/sharding.py`), keep a KV cache for only their KV heads, and run the same
forward pass; only rank 0 computes logits.

- `wire.py`: what rank 0 tells its helpers: the `HelperSpec` they start from, and each step as
  two int64 broadcasts (`pack_step` / `unpack_step`);
- `leader.py`: rank 0's side: start, feed, watch and stop the helpers;
- `helper.py`: a helper rank's process: load its shard, then run rank 0's steps until told to stop.

This package's `__init__` imports nothing, so that importing one part loads only what it needs.
"""
