"""CPU kernels in C, compiled on first use with the machine's C compiler and called via ctypes.

PyTorch has no paged attention for CPUs: decoding gathered every sequence's KV blocks into a
padded copy, then ran a flash-attention kernel built for long queries over it, which was half
of a 32-sequence decode step. `csrc/paged_attention.c` reads the blocks where they lie.
`csrc/fused_ops.c` fuses the small ops around it (RMSNorm, RoPE with the KV-cache write, w8a8's
activation scaling), each of which cost PyTorch 5 to 20 dispatches per layer. `csrc/int8_matmul.c`
is w8a8's matmul for CPUs with AVX-512 VNNI: the weights read once for all rows of a decode
batch, on every core (FBGEMM's takes one core per call and ~60 us of overhead at one row);
`csrc/amx_matmul.c` runs it on AMX tiles for batches of 8+ rows where the CPU has them.
`csrc/lora.c` adds each row's own LoRA update reading the adapters' weights in place (PyTorch
gathered them per row, or ran a matmul pair per adapter).

The interface is declared once, in `csrc/kernels.h`: `kernel_header` generates the ctypes
argument types and the argument structs from it, and the compiler checks every C definition
against it. The kernels are plain C with no PyTorch headers, so they build in about a second,
for this CPU (`kernel_build.py`, cached in `<cache_dir>/kernels`). Where no compiler works
(`load_kernels` returns None and logs why), or with `cpu_kernels` off
(`MODELYARD_CPU_KERNELS=false`), the engine keeps PyTorch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from modelyard.engine import kernel_build, kernel_header
from modelyard.engine.cores import usable_cores
from modelyard.engine.step_interrupt import StepInterrupted

if TYPE_CHECKING:
    from modelyard.engine.lora.groups import LoRAGroups

log = logging.getLogger(__name__)


def data_ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for a C pointer argument; NULL for None."""
    return None if t is None else t.data_ptr()


HEADER = kernel_header.read()  # csrc/kernels.h: the interface, and the types below
Attention = HEADER.struct("my_attention")
RopeKV = HEADER.struct("my_rope_kv")
Linear = HEADER.struct("my_linear")
GGUFLinear = HEADER.struct("my_gguf_linear")
LoRA = HEADER.struct("my_lora")
# the weights' dtypes `lora_add` reads: `my_lora.w_dtype`
LORA_WEIGHTS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}
Step = HEADER.struct("my_step")


class CpuKernels:
    """The compiled kernels. Inputs are float32 (the attention's cache may be bfloat16) CPU
    tensors, contiguous where noted; callers check, the C code trusts. The ctypes argument
    types come from `csrc/kernels.h` (`kernel_header`); the structs are filled by field name."""

    def __init__(self, library: ctypes.CDLL) -> None:
        c = kernel_header.bind(library, HEADER)
        self._attention = c["my_paged_decode_attention"]
        self._rms_norm = c["my_rms_norm"]
        self._rope_write_kv = c["my_rope_write_kv"]
        self._smooth_rows = c["my_smooth_rows"]
        self._int8_matmul = c["my_int8_matmul"]
        self._gguf_matmul = c["my_gguf_matmul"]
        self.gguf_block_bytes = c["my_gguf_block_bytes"]
        # The GGUF matmul's form in this build: 0 plain C, 2 AVX2, 3 AVX-512 VNNI.
        self.gguf_matmul_isa = int(c["my_gguf_matmul_isa"]())
        self._decode_step = c["my_decode_step"]
        self._lora_add = c["my_lora_add"]
        # Whether int8 adapter weights are multiplied in int8 (AVX-512 VNNI; `csrc/lora_int8.h`)
        self.lora_int8_dot = bool(c["my_lora_int8_dot"]())
        self._decode_step_scratch = c["my_decode_step_scratch"]
        # Only with VNNI does the C matmul beat FBGEMM (its plain-C form is a fallback for tests).
        self.int8_matmul_vectorized = bool(c["my_int8_matmul_vectorized"]())
        # Whether batches of rows run on AMX tiles (layers that keep an `amx_pack` copy).
        self.int8_amx = self.int8_matmul_vectorized and bool(c["my_int8_amx_available"]())
        self._amx_pack = c["my_int8_amx_pack"]
        self.matmul_threads = usable_cores()

    def decode_attention(
        self,
        q: torch.Tensor,  # [B, heads, head_dim] float32
        cache: torch.Tensor,  # [2, slots, kv_heads, head_dim] float32 or bfloat16, contiguous
        block_tables: torch.Tensor,  # [B, max_blocks] int64, contiguous
        context_lens: torch.Tensor,  # [B] int64, each >= 1
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """Attention output `[B, heads, head_dim]` float32, one query token per sequence."""
        q = q.contiguous()  # the fused path's queries are rows of q|k|v
        batch, heads, dim = q.shape
        out = torch.empty_like(q)
        args = Attention(
            q=q.data_ptr(),
            k_cache=cache[0].data_ptr(),
            v_cache=cache[1].data_ptr(),
            block_tables=block_tables.data_ptr(),
            context_lens=context_lens.data_ptr(),
            out=out.data_ptr(),
            batch=batch,
            heads=heads,
            kv_heads=cache.shape[2],
            dim=dim,
            block_size=block_size,
            max_blocks=block_tables.shape[1],
            scale=scale,
            bf16=int(cache.dtype == torch.bfloat16),
            n_threads=torch.get_num_threads(),
        )
        failed = self._attention(ctypes.byref(args))
        if failed:
            raise MemoryError("paged decode attention: no memory for the attention scores")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of `x` ([rows, cols], rows may be strided; columns contiguous)."""
        rows, cols = x.shape
        out = torch.empty(rows, cols)
        self._rms_norm(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, cols, x.stride(0), eps
        )
        return out

    def rope_write_kv(
        self,
        qkv: torch.Tensor,  # [T, (heads + 2 * kv_heads) * dim], contiguous: rotated in place
        rope_cos: torch.Tensor,  # [positions, dim], contiguous
        rope_sin: torch.Tensor,
        positions: torch.Tensor,  # [T] int64
        slots: torch.Tensor,  # [T] int64
        cache: torch.Tensor,  # [2, slots, kv_heads, dim] float32 or bfloat16, contiguous
        heads: int,
    ) -> None:
        """RoPE on every query and key head, then each token's key and value into its slot."""
        kv_heads, dim = cache.shape[2], cache.shape[3]
        args = RopeKV(
            qkv=qkv.data_ptr(),
            cos_table=rope_cos.data_ptr(),
            sin_table=rope_sin.data_ptr(),
            positions=positions.data_ptr(),
            slots=slots.data_ptr(),
            k_cache=cache[0].data_ptr(),
            v_cache=cache[1].data_ptr(),
            tokens=qkv.shape[0],
            heads=heads,
            kv_heads=kv_heads,
            dim=dim,
            row_stride=qkv.stride(0),
            max_positions=rope_cos.shape[0],
            bf16=int(cache.dtype == torch.bfloat16),
        )
        failed = self._rope_write_kv(ctypes.byref(args))
        if failed:
            raise IndexError(f"a position is outside the RoPE table of {rope_cos.shape[0]}")

    def smooth_rows(
        self, x: torch.Tensor, inv_smooth: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x * inv_smooth) / row_max` and `row_max` ([rows, 1]), the absmax of each row of
        `x * inv_smooth` (at least 1e-12)."""
        rows, cols = x.shape
        out = torch.empty(rows, cols)
        row_max = torch.empty(rows, 1)
        self._smooth_rows(
            x.data_ptr(),
            data_ptr(inv_smooth),
            out.data_ptr(),
            row_max.data_ptr(),
            rows,
            cols,
            x.stride(0),
        )
        return out, row_max

    def int8_matmul(
        self,
        x: torch.Tensor,  # [rows, K] float32, contiguous
        weight: torch.Tensor,  # [N, K] int8, contiguous
        weight_sums: torch.Tensor,  # [N] int32: each row's sum
        scale: torch.Tensor,  # [N] float32
        bias: torch.Tensor | None,  # [N] float32
        inv_smooth: torch.Tensor | None,  # [K] float32
        amx_weight: torch.Tensor | None = None,  # `amx_pack(weight)`
    ) -> torch.Tensor:
        """`quantize(x * inv_smooth) @ weight^T * scale (+ bias)`, x quantized per row to int8
        (symmetric), products summed in int32; on `matmul_threads` threads (on AMX tiles for
        batches of rows where `amx_weight` is given)."""
        rows, cols = x.shape
        out = torch.empty(rows, weight.shape[0])
        quantized = torch.empty(rows, cols, dtype=torch.uint8)
        row_scales = torch.empty(rows)
        linear = Linear(
            weight=weight.data_ptr(),
            weight_sums=weight_sums.data_ptr(),
            scale=scale.data_ptr(),
            bias=data_ptr(bias),
            inv_smooth=data_ptr(inv_smooth),
            amx_weight=data_ptr(amx_weight),
            out_features=weight.shape[0],
            in_features=cols,
        )
        self._int8_matmul(
            x.data_ptr(),
            rows,
            ctypes.byref(linear),
            out.data_ptr(),
            quantized.data_ptr(),
            row_scales.data_ptr(),
            self.matmul_threads,
        )
        return out

    def amx_pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """`weight` ([N, K] int8) in the AMX tiles' order, for `int8_matmul`'s `amx_weight`;
        None where AMX is not in use or the shape does not tile (N a multiple of 16, K of 64)."""
        n, k = weight.shape
        if not self.int8_amx or n % 16 or k % 64:
            return None
        out = torch.empty(n * k, dtype=torch.int8)
        self._amx_pack(weight.contiguous().data_ptr(), n, k, out.data_ptr())
        return out

    def gguf_matmul(
        self,
        x: torch.Tensor,  # [rows, K] float32, contiguous; K a multiple of 32
        blocks: torch.Tensor,  # [N, K / 32 * block bytes] uint8, contiguous
        ggml_type: int,  # 2 Q4_0, 3 Q4_1, 8 Q8_0
        bias: torch.Tensor | None,  # [N] float32
    ) -> torch.Tensor:
        """`quantize(x) @ W^T (+ bias)` with W in GGUF blocks (`csrc/gguf_matmul.c`), x
        quantized to int8 per block of 32; on `matmul_threads` threads."""
        rows, cols = x.shape
        out = torch.empty(rows, blocks.shape[0])
        quantized = torch.empty(rows, cols, dtype=torch.int8)
        scales = torch.empty(2 * rows * (cols // 32))
        linear = GGUFLinear(
            blocks=blocks.data_ptr(),
            bias=data_ptr(bias),
            out_features=blocks.shape[0],
            in_features=cols,
            type=ggml_type,
        )
        failed = self._gguf_matmul(
            x.data_ptr(),
            rows,
            ctypes.byref(linear),
            out.data_ptr(),
            quantized.data_ptr(),
            scales.data_ptr(),
            self.matmul_threads,
        )
        if failed:
            raise ValueError(f"GGUF matmul: GGML type {ggml_type} with {cols} inputs not taken")
        return out

    def lora_args(
        self,
        lora_a: torch.Tensor,  # [slots, parts * rank, in], each slot's contiguous
        lora_b: ctypes.Array[ctypes.c_void_p],  # each part's B [slots, rank, out_p] (int8: quads)
        slot_stride: int,  # elements from one slot's A (and B) to the next slot's
        part_sizes: torch.Tensor,  # [parts] int64
        part_rank: torch.Tensor,  # [slots, parts] int32: the slot's rank on the part, 0: none
        rank: int,  # the largest: A's and B's stride in rows
        scales: torch.Tensor,  # int8 weights: [slots, 2 * parts * rank] float32 row scales
    ) -> Any:
        """One wrapped projection's `my_lora` with its weights' fields, made once: `lora_add`
        fills in a call's rows (a whole struct per call cost ~12 us, 120 calls a SmolLM2 step).
        The tensors (and `lora_b`) must outlive it, in place."""
        return LoRA(
            a=lora_a.data_ptr(),
            slot_stride=slot_stride,
            b=ctypes.addressof(lora_b),
            part_sizes=part_sizes.data_ptr(),
            part_rank=part_rank.data_ptr(),
            parts=part_sizes.shape[0],
            rank=rank,
            scales=scales.data_ptr() if lora_a.dtype == torch.int8 else None,
            w_dtype=LORA_WEIGHTS[lora_a.dtype],
        )

    def lora_add(
        self,
        x: torch.Tensor,  # [T, in] float32 or bfloat16, columns contiguous
        y: torch.Tensor,  # [T, sum(part_sizes)] float32 or bfloat16, contiguous: updated
        groups: LoRAGroups,
        args: Any,  # the projection's `lora_args`
    ) -> None:
        """Each adapter row's `y[row] += x[row] @ A[slot] @ B[slot]` (see `csrc/lora.c`)."""
        args.x = x.data_ptr()
        args.x_stride = x.stride(0)
        args.x_bf16 = x.dtype == torch.bfloat16
        args.y = y.data_ptr()
        args.y_stride = y.stride(0)
        args.y_bf16 = y.dtype == torch.bfloat16
        args.rows = groups.rows_ptr
        args.groups = groups.starts_ptr
        args.slots = groups.slots_ptr
        args.n_groups = groups.n_groups
        args.in_features = x.shape[1]
        args.n_threads = self.matmul_threads
        failed = self._lora_add(ctypes.byref(args))
        if failed:
            raise MemoryError("LoRA kernel: no memory for its scratch")

    def decode_step(
        self,
        model: Any,  # ctypes reference to kernels.h's my_model (models/decode_step.py)
        x: torch.Tensor,  # [T, hidden] float32, contiguous: updated in place
        positions: torch.Tensor,  # [T] int64
        slots: torch.Tensor,  # [T] int64
        block_tables: torch.Tensor,  # [T, max_blocks] int64, contiguous
        context_lens: torch.Tensor,  # [T] int64
        widest_input: int,
        stop: int = 0,  # the address of an int32 another thread may raise (StepInterrupt)
    ) -> None:
        """A decode step's decoder layers (see `csrc/decode_step.c`); `StepInterrupted` when
        `stop` was raised before the last layer."""
        tokens = x.shape[0]
        scratch = torch.empty(self._decode_step_scratch(model, tokens))
        quantized = torch.empty(tokens * widest_input, dtype=torch.uint8)
        # a row's scale (w8a8), or a scale and a sum per block of 32 (GGUF blocks)
        row_scales = torch.empty(tokens * (2 * widest_input // 32 + 1))
        step = Step(
            x=x.data_ptr(),
            tokens=tokens,
            positions=positions.data_ptr(),
            slots=slots.data_ptr(),
            block_tables=block_tables.data_ptr(),
            context_lens=context_lens.data_ptr(),
            max_blocks=block_tables.shape[1],
            scratch=scratch.data_ptr(),
            xq=quantized.data_ptr(),
            xscale=row_scales.data_ptr(),
            stop=stop or None,
        )
        failed = self._decode_step(model, ctypes.byref(step))
        if failed == 3:
            raise StepInterrupted
        if failed == 1:
            raise IndexError("a position is outside the RoPE table")
        if failed:
            raise MemoryError("paged decode attention: no memory for the attention scores")


@functools.cache
def load_kernels(cache_dir: Path) -> CpuKernels | None:
    """The compiled kernels (built once per process), or None where they cannot be built."""
    return build_kernels(cache_dir)


def build_kernels(cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> CpuKernels | None:
    """Compile (unless cached under `cache_dir/kernels`) and load the kernels; None, logged,
    where that fails."""
    compiler = kernel_build.compiler()
    if compiler is None:
        log.warning("no C compiler (cc, gcc or $CC): the CPU engine runs PyTorch's ops (slower)")
        return None
    try:
        built = kernel_build.build(
            kernel_build.SOURCES, compiler, cache_dir / "kernels", extra_flags
        )
        library = ctypes.CDLL(str(built))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("modelyard's C kernels did not build (%s): PyTorch runs their ops", exc)
        return None
    return CpuKernels(library)


def kernels_for(device: torch.device, cache_dir: Path) -> CpuKernels | None:
    """The kernels where they serve an engine on `device`, else None."""
    return load_kernels(cache_dir) if device.type == "cpu" else None
