"""How much device memory a replica of a model will take, from its files and engine settings.

weights (parameter count × the engine's dtype width, split over tensor-parallel ranks) + the KV
cache budget (per rank) + a fixed overhead. Parameter counts come from safetensors headers; a
GGUF file's are estimated from its size at ~4.5 bits a weight (its common Q4 types), which errs
on the large side for 8-bit files' neighbours and is replaced by the converted weights' exact
count once this node holds them.
"""

from __future__ import annotations

from pathlib import Path

from modelyard.config import EngineSettings

_GGUF_BITS_PER_WEIGHT = 4.5


def num_params(model_path: Path) -> int:
    if model_path.is_file() and model_path.suffix == ".gguf":
        return int(model_path.stat().st_size * 8 / _GGUF_BITS_PER_WEIGHT)
    folder = model_path if model_path.is_dir() else model_path.parent
    weights = sorted(folder.glob("*.safetensors"))
    if weights:
        from modelyard.encoders.loading import safetensors_numel  # lazily: it imports torch

        return sum(safetensors_numel(w) for w in weights)
    # pytorch_model*.bin: most are stored in 16-bit.
    return sum(f.stat().st_size // 2 for f in folder.glob("pytorch_model*.bin"))


def dtype_bytes(engine: EngineSettings, on_cuda: bool) -> int:
    if engine.dtype == "float32":
        return 4
    if engine.dtype == "bfloat16":
        return 2
    from modelyard.engine.loading import cpu_has_native_bfloat16

    return 2 if on_cuda or cpu_has_native_bfloat16() else 4


def replica_bytes_per_device(
    model_path: Path, engine: EngineSettings, on_cuda: bool, overhead: int
) -> int:
    """Memory each of the replica's `tensor_parallel_size` devices must have free."""
    tp = max(1, engine.tensor_parallel_size)
    weights = num_params(model_path) * dtype_bytes(engine, on_cuda)
    return weights // tp + engine.kv_cache_memory + overhead
