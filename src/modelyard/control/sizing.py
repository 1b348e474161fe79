"""How much device memory a replica of a model will take, from its recorded size and engine
settings.

weights (parameter count × the engine's dtype width, split over tensor-parallel ranks) + the KV
cache budget (per rank) + a fixed overhead. The parameter count is the one recorded when the
version was pushed (`core/model_files.py`: exact from safetensors headers checked against hard
limits; a GGUF file's estimated from its size at ~4.5 bits a weight), never read from the files
here: this runs on the platform's event loop.
"""

from __future__ import annotations

from modelyard.config import EngineSettings


def dtype_bytes(engine: EngineSettings, on_cuda: bool) -> int:
    if engine.dtype == "float32":
        return 4
    if engine.dtype == "bfloat16":
        return 2
    from modelyard.engine.loading import cpu_has_native_bfloat16

    return 2 if on_cuda or cpu_has_native_bfloat16() else 4


def replica_bytes_per_device(
    param_count: int, engine: EngineSettings, on_cuda: bool, overhead: int
) -> int:
    """Memory each of the replica's `tensor_parallel_size` devices must have free."""
    tp = max(1, engine.tensor_parallel_size)
    weights = param_count * dtype_bytes(engine, on_cuda)
    return weights // tp + engine.kv_cache_memory + overhead
