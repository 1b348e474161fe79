"""A decode step's decoder layers in one C call (`csrc/decode_step.c`): the layers' weights,
norms and KV caches described once to the C code, then one call per step instead of ~10 module
calls per layer. It applies where every piece already runs in C: a Llama-family model on CPU
with w8a8 weights in the C matmul's form (AVX-512 VNNI), one rank, no per-head q/k norm, no LoRA
layers, and a step of decodes only (prefill chunks go through the modules).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
from torch import nn

from modelyard.engine.cpu_kernels import data_ptr
from modelyard.engine.quantization import Int8Linear

if TYPE_CHECKING:
    from modelyard.engine.attention import AttentionMetadata
    from modelyard.engine.cpu_kernels import CpuKernels

_ptr, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class _Linear(ctypes.Structure):
    _fields_ = [
        ("weight", _ptr),
        ("weight_sums", _ptr),
        ("scale", _ptr),
        ("bias", _ptr),
        ("inv_smooth", _ptr),
        ("out", _i64),
        ("in_", _i64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_attention_norm", _ptr),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(_Layer)),
        ("n_layers", _i64),
        ("hidden", _i64),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("rope_cos", _ptr),
        ("rope_sin", _ptr),
        ("max_positions", _i64),
        ("block_size", _i64),
        ("eps", _f32),
        ("attention_scale", _f32),
        ("bf16_cache", _int),
        ("matmul_threads", _int),
        ("attention_threads", _int),
    ]


def _linear(layer: nn.Module | None) -> _Linear | None:
    """The C description of a w8a8 layer in plain int8 rows, or None for anything else."""
    if not isinstance(layer, Int8Linear) or layer.kernel != "fbgemm" or layer.packed is not None:
        return None
    return _Linear(
        layer.qweight.data_ptr(),
        layer.weight_sums.data_ptr(),
        layer.scale.data_ptr(),
        data_ptr(layer.bias),
        data_ptr(layer.inv_smooth),
        layer.out_features,
        layer.in_features,
    )


class DecodeStep:
    """The model and its caches as the C step sees them; `None` from `describe` where it does
    not apply. Holds pointers into the model's and caches' storage: rebuilt when either
    changes (`use_kernels` drops it; a different cache list is checked on every call)."""

    def __init__(
        self, kernels: CpuKernels, model: _Model, layers: ctypes.Array, caches: list[torch.Tensor]
    ) -> None:
        self.kernels = kernels
        self.model = model
        self._layers = layers  # kept alive: `model` points into it
        self.cache_ptr = caches[0].data_ptr()
        self.widest_input = max(
            max(layer.qkv.in_, layer.o.in_, layer.gate_up.in_, layer.down.in_) for layer in layers
        )

    @classmethod
    def describe(
        cls, lm: nn.Module, kernels: CpuKernels, caches: list[torch.Tensor]
    ) -> DecodeStep | None:
        cfg = lm.config  # type: ignore[attr-defined]
        if lm.tp_size != 1 or not kernels.int8_matmul_vectorized:  # type: ignore[attr-defined]
            return None
        if caches[0].dtype not in (torch.float32, torch.bfloat16):
            return None
        inner = lm.model  # type: ignore[attr-defined]
        described = []
        for layer, cache in zip(inner.layers, caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            if attn.q_norm is not None or not cache.is_contiguous():
                return None
            parts = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj)]
            parts.append(_linear(mlp.down_proj))
            if any(p is None for p in parts):
                return None
            described.append(
                _Layer(
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    *parts,
                    cache[0].data_ptr(),
                    cache[1].data_ptr(),
                )
            )
        layers = (_Layer * len(described))(*described)
        first = inner.layers[0].self_attn
        rope = inner.rotary
        model = _Model(
            layers,
            len(described),
            cfg.hidden_size,
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            inner.layers[0].mlp.intermediate,
            rope.cos.data_ptr(),
            rope.sin.data_ptr(),
            rope.cos.shape[0],
            0,  # block size: set from the first step's metadata
            inner.layers[0].input_layernorm.eps,
            first.scale,
            int(caches[0].dtype == torch.bfloat16),
            kernels.matmul_threads,
            kernels.matmul_threads,  # no PyTorch op in the step: its threads are all asleep
        )
        return cls(kernels, model, layers, caches)

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The decoder layers over `x` ([T, hidden] float32, contiguous), in place; every row a
        decode (`meta.num_decodes == T`)."""
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
        )


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
        return step
