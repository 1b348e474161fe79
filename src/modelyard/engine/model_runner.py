"""`ModelRunner`: owns the model and its KV cache tensors; turns a scheduled step into logits.

It flattens the step's sequences into one token batch (decodes first, then prefill chunks),
computes each new token's cache slot from the block tables, runs the model and returns the
logits of the positions that sample a next token.

With tensor parallelism this is rank 0's runner: `execute` first broadcasts the step to the
helper ranks (`TensorParallelLeader.send_step`), whose own runners call `forward` with it; the KV
cache of every rank holds only that rank's KV heads.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from modelyard.engine.attention import AttentionMetadata, PrefillChunk
from modelyard.engine.models.config import ModelConfig
from modelyard.engine.models.llama import LlamaForCausalLM
from modelyard.engine.sequence import Sequence

if TYPE_CHECKING:
    from modelyard.engine.cpu_kernels import CpuKernels
    from modelyard.engine.lora.manager import LoRAManager
    from modelyard.engine.tensor_parallel.leader import TensorParallelLeader


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # weights, activations, KV


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_seqs: list[Sequence]  # in the order of logits_indices (1 + len(draft) rows each)
    lora_slots: list[int] | None = None  # per flat-batch token: its adapter slot (0 = base)


def allocate_kv_caches(
    shape: tuple[int, ...], layers: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One zeroed `[2, slots, kv_heads, head_dim]` tensor per layer.

    On CPU they are views of one anonymous memory mapping: the kernel hands out zero pages
    lazily, so a multi-GB cache costs nothing until used (zero-filling it up front took ~3 s
    for 1 GiB, most of a cold start). Zeros matter: padded slots are read, then masked, and a
    NaN in an unmasked-by-weight V would survive `0 * NaN`.
    """
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
    per_layer = math.prod(shape)
    buffer = mmap.mmap(-1, per_layer * layers * dtype.itemsize)
    flat = torch.frombuffer(buffer, dtype=dtype, count=per_layer * layers)
    return [flat[i * per_layer : (i + 1) * per_layer].view(shape) for i in range(layers)]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tp_size: int = 1,
        leader: TensorParallelLeader | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """`kv_dtype`: the KV cache's element type (default: the model's `dtype`)."""
        self.model = model
        self.config = config
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.tp_size = tp_size
        self.leader = leader
        self.lora: LoRAManager | None = None  # set by `loading` when max_loras > 0
        num_slots = num_blocks * block_size
        shape = (2, num_slots, config.num_key_value_heads // tp_size, config.head_dim)
        self.kv_caches = allocate_kv_caches(
            shape, config.num_hidden_layers, kv_dtype or dtype, device
        )
        self.kernels: CpuKernels | None = None  # `use_kernels`

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs = self.block_size
        table = seq.block_ids
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _block_tables(self, tables: list[list[int]], num_tokens: int) -> torch.Tensor:
        """`[len(tables), blocks]` ids of the blocks holding positions 0..num_tokens-1."""
        nb = -(-num_tokens // self.block_size)
        rows = [t[:nb] + [0] * (nb - len(t[:nb])) for t in tables]
        return torch.tensor(rows, dtype=torch.long).to(self.device)

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> StepInputs:
        decodes = [(s, n) for s, n in scheduled if n == 1]
        prefills = [(s, n) for s, n in scheduled if n != 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        sampling_seqs: list[Sequence] = []
        chunks: list[PrefillChunk] = []
        lora_slots: list[int] | None = [] if self.lora is not None else None

        for seq, n in decodes + prefills:
            start = seq.num_computed_tokens
            end = start + n
            offset = len(input_ids)
            if lora_slots is not None and self.lora is not None:
                lora_slots.extend([self.lora.slot_of(seq.request_id)] * n)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(seq, start, end))
            if n != 1:
                blocks = self._block_tables([seq.block_ids], end)[0] if start else None
                chunks.append(PrefillChunk(offset, offset + n, start, blocks))
            if seq.draft:  # last token and draft: the logits of every position verify it
                input_ids.extend(seq.draft)
                logits_indices.extend(range(offset, offset + n))
                sampling_seqs.append(seq)
            elif end == seq.num_tokens:  # the chunk reaches the last known token: sample after it
                logits_indices.append(offset + n - 1)
                sampling_seqs.append(seq)

        decode_tables = decode_mask = lengths = None
        if decodes:
            lengths = torch.tensor([s.num_computed_tokens + 1 for s, _ in decodes])
            decode_tables = self._block_tables(
                [s.block_ids for s, _ in decodes], int(lengths.max())
            )
            if self.kernels is None:
                padded_len = decode_tables.shape[1] * self.block_size
                mask = torch.arange(padded_len) < lengths.unsqueeze(1)
                decode_mask = mask.view(len(decodes), 1, 1, padded_len).to(self.device)

        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            block_size=self.block_size,
            num_decodes=len(decodes),
            decode_block_tables=decode_tables,
            decode_mask=decode_mask,
            prefills=chunks,
            kernels=self.kernels,
            decode_lengths=lengths,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
            sampling_seqs=sampling_seqs,
            lora_slots=lora_slots,
        )

    def use_kernels(self, kernels: CpuKernels | None) -> None:
        """Run decode attention and the model's fused ops through modelyard's C kernels (CPU,
        one rank), or through PyTorch's ops (None)."""
        self.kernels = kernels
        self.model.use_kernels(kernels)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Float32 logits `[len(sampling_seqs), vocab]`."""
        if self.lora is not None:
            self.lora.set_rows(inputs.lora_slots or [], self.device)
        if self.leader is None:
            hidden = self.forward(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            with self.leader.step():
                self.leader.send_step(inputs.input_ids, inputs.positions, inputs.meta)
                hidden = self.forward(inputs.input_ids, inputs.positions, inputs.meta)
        if len(inputs.logits_indices) == 0:  # prompt chunks only: no sequence samples
            return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states of the flat batch; every tensor-parallel rank runs this each step."""
        hidden: torch.Tensor = self.model(input_ids, positions, meta, self.kv_caches)
        return hidden

    def close(self) -> None:
        """Stop the helper ranks, if any (idempotent)."""
        if self.leader is not None:
            self.leader.close()
