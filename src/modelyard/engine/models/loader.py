"""Find a model (HF folder, GGUF file or a bundled name), load its weights and tokenizer."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from modelyard.engine.gguf_linear import GGUF_QUANTIZATIONS
from modelyard.engine.models.bundled import ModelNotFoundError, resolve_model_path
from modelyard.engine.models.config import ModelConfig
from modelyard.engine.models.gguf_blocks import keep_gguf_blocks
from modelyard.engine.models.gguf_convert import convert_gguf
from modelyard.engine.models.llama import LlamaForCausalLM
from modelyard.engine.models.moe import check_moe_features, checkpoint_name
from modelyard.engine.models.packed_linear import packing_available
from modelyard.engine.models.quantize import quantize_model
from modelyard.engine.models.sharding import Slice, check_tensor_parallel, shard_slice
from modelyard.engine.quantization import QUANTIZATIONS

log = logging.getLogger(__name__)


def to_hf_folder(ref: str | Path, cache_dir: Path) -> Path:
    path = resolve_model_path(ref)
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir)
    if path.is_file():
        raise ModelNotFoundError(f"{path}: expected a .gguf file or a Hugging Face model folder")
    return path


def gguf_file(ref: str | Path) -> Path | None:
    """The GGUF file a model reference names, or None where it names a folder."""
    path = resolve_model_path(ref)
    return path if path.is_file() and path.suffix == ".gguf" else None


def read_model_config(folder: Path) -> ModelConfig:
    raw = json.loads((folder / "config.json").read_text())
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if gen_eos is not None:
            raw["eos_token_id"] = gen_eos
    return ModelConfig.from_hf_dict(raw)


def _load_state_dict(
    folder: Path, shard: Callable[[str], Slice | None] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint; with `shard`, only the slice it names of each one (read
    straight from safetensors files, so a tensor-parallel rank never holds the whole model)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    part = shard(name) if shard else None
                    if part is None:
                        state[name] = st.get_tensor(name)
                        continue
                    dim, start, end = part
                    sl = st.get_slice(name)
                    state[name] = sl[start:end] if dim == 0 else sl[:, start:end]
        return state
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelNotFoundError(f"{folder} has no *.safetensors or pytorch_model*.bin weights")
    for f in bins:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    if shard:
        for name, tensor in state.items():
            part = shard(name)
            if part is not None:
                dim, start, end = part
                state[name] = tensor.narrow(dim, start, end - start).clone()
    return state


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    folder: Path


def load_model(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    pack_cpu_linears: bool = True,
    tp_rank: int = 0,
    tp_size: int = 1,
    quantization: str | None = None,
    gguf_path: Path | None = None,
) -> LoadedModel:
    """Load the model, or with `tp_size > 1` rank `tp_rank`'s shard of it (see `sharding`);
    `quantization`: "int8" (weight-only) or "w8a8" linears (see `engine.quantization`), or
    "gguf": the blocks of `gguf_path`, the file `folder` was converted from, kept as they are
    (see `models.gguf_blocks`); "gguf+w8a8": those blocks, each with its w8a8 copy for wide
    matmuls (`engine.gguf_linear`)."""
    cfg = read_model_config(folder)
    check_moe_features(cfg, tp_size, quantization)
    check_tensor_parallel(cfg, tp_size)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, tp_size)
    shard = partial(shard_slice, cfg=cfg, rank=tp_rank, tp=tp_size) if tp_size > 1 else None
    state = _load_state_dict(folder, shard)
    if cfg.moe is not None:
        state = {checkpoint_name(name): tensor for name, tensor in state.items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict()}
    missing = expected - state.keys()
    if missing:
        raise ValueError(f"{folder}: weights missing from the checkpoint: {sorted(missing)[:5]}")
    unexpected = sorted(k for k in state.keys() - expected if "rotary_emb" not in k)
    if unexpected:
        log.warning("ignoring %d unexpected tensors, e.g. %s", len(unexpected), unexpected[:3])
    state = {k: v.to(dtype) for k, v in state.items() if k in expected}
    model.load_state_dict(state, assign=True, strict=True)
    model.fuse_projections()
    model = model.to(device).eval()
    if quantization in GGUF_QUANTIZATIONS:
        if gguf_path is None:
            raise ValueError(
                f"quantization {quantization!r} keeps a GGUF file's blocks: {folder} is no GGUF"
            )
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(
                f"quantization {quantization!r} runs on CPUs with float32 activations, "
                f"not {device} {dtype}"
            )
        if quantization == "gguf+w8a8":  # w8a8 first: its layers become the blocks' `wide` copies
            quantize_model(model, dtype, "w8a8")
            keep_gguf_blocks(model, gguf_path, dtype)
            return LoadedModel(model=model, config=cfg, folder=folder)
        keep_gguf_blocks(model, gguf_path, dtype)  # the other matrices stay float, packed below
    elif quantization in QUANTIZATIONS:
        quantize_model(model, dtype, quantization)
        return LoadedModel(model=model, config=cfg, folder=folder)
    elif quantization is not None:
        supported = (*QUANTIZATIONS, *GGUF_QUANTIZATIONS)
        raise ValueError(f"unknown quantization {quantization!r}; supported: {supported}")
    if pack_cpu_linears and packing_available(device, dtype):
        model.pack_for_cpu()
    return LoadedModel(model=model, config=cfg, folder=folder)
