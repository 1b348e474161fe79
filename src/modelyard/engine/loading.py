"""Loading an engine's parts: device and dtype, the model on its ranks, the KV cache size.

`LLMEngine.from_settings` builds itself from what `load` returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from modelyard.config import EngineSettings
from modelyard.engine.cores import threads_per_rank
from modelyard.engine.cpu_kernels import kernels_for
from modelyard.engine.defaults import (
    Choice,
    Numerics,
    choose_defaults,
    cpu_features,
    describe_model_file,
)
from modelyard.engine.gguf_linear import GGUF_QUANTIZATIONS
from modelyard.engine.lora.layers import slot_dtype
from modelyard.engine.lora.manager import LoRAManager
from modelyard.engine.memory import keep_freed_memory_for_reuse
from modelyard.engine.model_runner import DTYPES, ModelRunner
from modelyard.engine.models.bundled import resolve_model_path
from modelyard.engine.models.loader import (
    gguf_file,
    load_model,
    read_model_config,
    to_hf_folder,
)
from modelyard.engine.models.moe import check_moe_features
from modelyard.engine.models.sharding import check_tensor_parallel
from modelyard.engine.tensor_parallel.leader import TensorParallelLeader
from modelyard.engine.tensor_parallel.wire import HelperSpec, rank_device
from modelyard.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedEngine:
    runner: ModelRunner
    tokenizer: Tokenizer
    max_model_len: int
    num_blocks: int
    model_name: str
    numerics: Numerics


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_native_bfloat16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 matmuls run about twice as fast as float32 on such CPUs."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device, quantization: str) -> torch.dtype:
    if name == "auto":
        if quantization in ("w8a8", *GGUF_QUANTIZATIONS):  # int8 matmuls on float32 activations
            return torch.float32
        if device.type == "cuda" or cpu_has_native_bfloat16():
            return torch.bfloat16
        return torch.float32
    return DTYPES[name]


def choice_for(model: str | Path, settings: EngineSettings) -> Choice:
    """What `load` will choose for `model` under `settings` (quantization, KV cache dtype), before
    loading it (the model's file is read, and a GGUF converted once, as `load` does)."""
    source = resolve_model_path(model)
    folder = to_hf_folder(source, settings.cache_dir)
    device_type = resolve_device(settings.device).type
    return choose_defaults(
        describe_model_file(source, folder), cpu_features(), settings, device_type
    )


def load(model: str | Path, settings: EngineSettings) -> LoadedEngine:
    """Load the model and size its KV cache. With `tensor_parallel_size` N > 1 this process
    becomes rank 0 and starts N-1 helper rank processes (stopped by the runner's `close()`)."""
    tp = settings.tensor_parallel_size
    device = resolve_device(settings.device)
    num_threads = settings.num_threads
    if tp > 1:
        device = rank_device(device, 0)
        if device.type == "cpu" and not num_threads:
            num_threads = threads_per_rank(tp)
    if num_threads:
        torch.set_num_threads(num_threads)
    source = resolve_model_path(model)
    folder = to_hf_folder(source, settings.cache_dir)
    choice = choice_for(model, settings)
    quantization = choice.quantization
    dtype = resolve_dtype(settings.dtype, device, quantization)
    kv_dtype = dtype if choice.kv_cache_dtype == "auto" else DTYPES[choice.kv_cache_dtype]
    numerics = Numerics.of(choice, _name(dtype), _name(kv_dtype))
    log.info("%s", numerics.reason)
    if device.type == "cpu":
        keep_freed_memory_for_reuse()
    cfg = read_model_config(folder)
    quantized = None if quantization == "none" else quantization
    check_moe_features(cfg, tp, quantized, settings.max_loras)
    check_tensor_parallel(cfg, tp)
    if tp > 1 and (quantized or settings.max_loras):
        raise ValueError(
            "quantization and max_loras are not supported with tensor_parallel_size > 1"
        )
    if tp > 1 and settings.preemption_mode == "swap":
        raise ValueError(
            "preemption_mode=swap is not supported with tensor_parallel_size > 1 (the helper "
            "ranks' KV caches cannot be swapped); use auto or recompute"
        )
    if tp > 1 and device.type == "cuda":
        available = torch.cuda.device_count()
        if (device.index or 0) + tp > available:
            raise ValueError(
                f"tensor_parallel_size={tp} needs CUDA devices {device.index or 0}.."
                f"{(device.index or 0) + tp - 1}, but this node has {available}"
            )
    limits = [cfg.max_position_embeddings]
    if settings.max_model_len:
        limits.append(settings.max_model_len)
    if cfg.sliding_window:
        limits.append(cfg.sliding_window)
    max_model_len = min(limits)
    # Each rank holds its 1/tp of the KV heads in its own kv_cache_memory.
    bytes_per_block = settings.block_size * cfg.kv_bytes_per_token(kv_dtype.itemsize) // tp
    num_blocks = settings.kv_cache_memory // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={settings.kv_cache_memory} bytes holds no block of "
            f"{bytes_per_block} bytes; raise MODELYARD_KV_CACHE_MEMORY"
        )
    leader = None
    if tp > 1:
        spec = HelperSpec(
            folder=str(folder),
            dtype=_name(dtype),
            kv_dtype=_name(kv_dtype),
            device=str(device),
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            block_size=settings.block_size,
            num_threads=num_threads,
            world_size=tp,
            log_level=logging.getLogger().getEffectiveLevel(),
        )
        leader = TensorParallelLeader(spec, device)
    try:
        if leader is not None:
            leader.start()
        loaded = load_model(
            folder,
            dtype,
            device,
            max_model_len,
            tp_rank=0,
            tp_size=tp,
            quantization=quantized,
            gguf_path=gguf_file(model) if quantized in GGUF_QUANTIZATIONS else None,
        )
        runner = ModelRunner(
            loaded.model,
            cfg,
            num_blocks,
            settings.block_size,
            dtype,
            device,
            tp,
            leader,
            kv_dtype=kv_dtype,
        )
        use_kernels = settings.cpu_kernels and tp == 1  # tensor-parallel steps: PyTorch's mask
        kernels = kernels_for(device, settings.cache_dir) if use_kernels else None
        if settings.max_loras:  # before the kernels: the LoRA layers take them too
            int8_dot = kernels is not None and kernels.lora_int8_dot
            weights = slot_dtype(
                settings.lora_weight_dtype, dtype, device, quantized is not None, int8_dot
            )
            runner.lora = LoRAManager(
                loaded.model,
                cfg,
                settings.max_loras,
                settings.max_lora_rank,
                settings.lora_dir,
                weights,
            )
            runner.lora.registry_dir = settings.lora_registry_dir
        if use_kernels:
            runner.use_kernels(kernels)
        tokenizer = Tokenizer.load(folder, cfg)
        if leader is not None:
            leader.wait_ready()
    except BaseException:
        if leader is not None:
            leader.close()
        raise
    log.info(
        "engine ready: %s, %s on %s%s, %d KV blocks of %d tokens (%d tokens), max_model_len %d",
        model,
        dtype,
        device,
        f" x {tp} tensor-parallel ranks" if tp > 1 else "",
        num_blocks,
        settings.block_size,
        num_blocks * settings.block_size,
        max_model_len,
    )
    name = Path(str(model)).name if Path(str(model)).exists() else str(model)
    return LoadedEngine(runner, tokenizer, max_model_len, num_blocks, name, numerics)
