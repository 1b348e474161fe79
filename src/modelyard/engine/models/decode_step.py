"""A decode step's decoder layers in one C call (`csrc/decode_step.c`): the layers' weights,
norms and KV caches described once to the C code, then one call per step instead of ~10 module
calls per layer. It applies where every piece already runs in C: a Llama-family model on CPU
whose matmuls are each either w8a8 in the C matmul's form (AVX-512 VNNI) or GGUF blocks read in
place (quantization `gguf`, any CPU; under `gguf+w8a8` only steps of up to `BLOCK_ROWS_MAX`
rows), one rank, no q/k norm, no experts, no LoRA layers, and a
step of decodes only (prefill chunks go through the modules).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from modelyard.engine.cpu_kernels import HEADER, data_ptr
from modelyard.engine.gguf_linear import BLOCK_ROWS_MAX, GGUFLinear
from modelyard.engine.quantization import Int8Linear

if TYPE_CHECKING:
    from modelyard.engine.attention import AttentionMetadata
    from modelyard.engine.cpu_kernels import CpuKernels

# The C step's structs, generated from csrc/kernels.h (filled by field name below).
_Linear = HEADER.struct("my_linear")
_GGUFLinear = HEADER.struct("my_gguf_linear")
_Projection = HEADER.struct("my_projection")
_Layer = HEADER.struct("my_layer")
_Model = HEADER.struct("my_model")
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def _projection(layer: nn.Module | None, kernels: CpuKernels) -> ctypes.Structure | None:
    """The C description (a `_Projection`) of a matmul the step runs in C: w8a8 in plain int8
    rows where the C int8 matmul is vectorised, or GGUF blocks; None for anything else."""
    if isinstance(layer, GGUFLinear) and layer.kernels is not None:
        if layer.bias is not None and layer.bias.dtype != torch.float32:
            return None  # the C matmul adds a float32 bias
        gguf = _GGUFLinear(
            blocks=layer.blocks.data_ptr(),
            bias=data_ptr(layer.bias),
            out_features=layer.out_features,
            in_features=layer.in_features,
            type=layer.ggml_type,
        )
        return _Projection(gguf=gguf)
    if not isinstance(layer, Int8Linear) or layer.kernel != "fbgemm" or layer.packed is not None:
        return None
    if not kernels.int8_matmul_vectorized:  # FBGEMM's matmul, module by module, is faster
        return None
    assert layer.qweight is not None and layer.weight_sums is not None  # unpacked
    int8 = _Linear(
        weight=layer.qweight.data_ptr(),
        weight_sums=layer.weight_sums.data_ptr(),
        scale=layer.scale.data_ptr(),
        bias=data_ptr(layer.bias),
        inv_smooth=data_ptr(layer.inv_smooth),
        amx_weight=data_ptr(layer.amx_weight),
        out_features=layer.out_features,
        in_features=layer.in_features,
    )
    return _Projection(int8=int8)


class DecodeStep:
    """The model and its caches as the C step sees them; `None` from `describe` where it does
    not apply. Holds pointers into the model's and caches' storage: rebuilt when either
    changes (`use_kernels` drops it; a different cache list is checked on every call)."""

    def __init__(
        self,
        kernels: CpuKernels,
        model: ctypes.Structure,
        layers: ctypes.Array[Any],
        caches: list[torch.Tensor],
    ) -> None:
        self.kernels = kernels
        self.model = model
        self._layers = layers  # kept alive: `model` points into it
        self.cache_ptr = caches[0].data_ptr()
        self.widest_input = max(
            max(p.int8.in_features or p.gguf.in_features for p in _projections(layer))
            for layer in layers
        )
        self.max_rows: int | None = None  # steps of more rows go through the modules

    @classmethod
    def describe(
        cls, lm: nn.Module, kernels: CpuKernels, caches: list[torch.Tensor]
    ) -> DecodeStep | None:
        # Read structurally: llama.py imports this module, so its classes cannot be named here.
        model_any: Any = lm
        cfg = model_any.config
        if model_any.tp_size != 1 or cfg.moe is not None:
            return None
        if caches[0].dtype not in (torch.float32, torch.bfloat16):
            return None
        inner: Any = model_any.model
        described: list[ctypes.Structure] = []
        for layer, cache in zip(inner.layers, caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            if attn.q_norm is not None or not cache.is_contiguous():
                return None
            modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            qkv, o, gate_up, down = (_projection(m, kernels) for m in modules)
            if qkv is None or o is None or gate_up is None or down is None:
                return None
            described.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight.data_ptr(),
                    post_attention_norm=layer.post_attention_layernorm.weight.data_ptr(),
                    qkv=qkv,
                    o=o,
                    gate_up=gate_up,
                    down=down,
                    k_cache=cache[0].data_ptr(),
                    v_cache=cache[1].data_ptr(),
                )
            )
        layers = (_Layer * len(described))(*described)
        first = inner.layers[0].self_attn
        rope = inner.rotary
        model = _Model(
            layers=layers,
            n_layers=len(described),
            hidden=cfg.hidden_size,
            heads=first.num_heads,
            kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            intermediate=inner.layers[0].mlp.intermediate,
            rope_cos=rope.cos.data_ptr(),
            rope_sin=rope.sin.data_ptr(),
            max_positions=rope.cos.shape[0],
            block_size=0,  # set from the first step's metadata
            eps=inner.layers[0].input_layernorm.eps,
            attention_scale=first.scale,
            bf16_cache=int(caches[0].dtype == torch.bfloat16),
            matmul_threads=kernels.matmul_threads,
            attention_threads=kernels.matmul_threads,  # no PyTorch op in the step: all asleep
        )
        step = cls(kernels, model, layers, caches)
        if any(isinstance(m, GGUFLinear) and m.wide is not None for m in lm.modules()):
            step.max_rows = BLOCK_ROWS_MAX  # wider steps: the modules, on the `wide` copies
        return step

    def run(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, stop: int = 0
    ) -> None:
        """The decoder layers over `x` ([T, hidden] float32, contiguous), in place; every row a
        decode (`meta.num_decodes == T`). `stop`: `StepInterrupt.address()`."""
        assert meta.decode_block_tables is not None and meta.decode_lengths is not None
        self.model.block_size = meta.block_size
        self.kernels.decode_step(
            ctypes.byref(self.model),
            x,
            positions,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_lengths,
            self.widest_input,
            stop,
        )


def _projections(layer: ctypes.Structure) -> list[Any]:
    return [getattr(layer, name) for name in PROJECTIONS]


class OneCallDecode:
    """For one model: whether a step runs as one C call, and its description (made on the
    first step it applies to, forgotten when the model's kernels change). `enabled` off keeps
    every step in the modules (tests and benchmarks compare the two)."""

    def __init__(self) -> None:
        self.enabled = True
        self.described: DecodeStep | None = None
        self._inapplicable = False

    def forget(self) -> None:
        self.described, self._inapplicable = None, False

    def step_for(
        self,
        lm: nn.Module,
        kernels: CpuKernels | None,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> DecodeStep | None:
        """The one-call step for this step of `lm`, or None (the modules run it)."""
        if kernels is None or not self.enabled or self._inapplicable or meta.prefills:
            return None
        if meta.num_decodes != input_ids.shape[0] or meta.kernels is None:
            return None
        step = self.described
        if step is None or step.cache_ptr != kv_caches[0].data_ptr():
            step = self.described = DecodeStep.describe(lm, kernels, kv_caches)
            self._inapplicable = step is None  # the model's form holds until `forget`
        if step is not None and step.max_rows is not None and input_ids.shape[0] > step.max_rows:
            return None
        return step
