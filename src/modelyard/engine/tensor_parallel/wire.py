"""What rank 0 tells its tensor-parallel helpers: the spec they start from, and each step.

A helper starts from a `HelperSpec` (JSON on its command line). Per step the wire format is two
broadcasts of int64 tensors, no pickling:

- a fixed header of `HEADER_LEN` values: command, payload length, T (tokens), decodes,
  decode block-table width, prefill chunks;
- the payload: token ids [T], positions [T], slot mapping [T], the decodes' padded block tables
  [decodes * width], one (start, end, num_computed, n_context_blocks) row per prefill chunk,
  then the chunks' context block ids. The decode mask is rebuilt from the positions.

`pack_step` writes a step's inputs in this form; `unpack_step` rebuilds them on a helper.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from modelyard.engine.attention import AttentionMetadata, PrefillChunk

HEADER_LEN = 8
CMD_STEP, CMD_NOOP, CMD_STOP = 1, 2, 3
COLLECTIVE_TIMEOUT_S = 120.0  # any one broadcast / all-reduce
STARTUP_TIMEOUT_S = 900.0  # helpers loading their shards


class TensorParallelError(RuntimeError):
    """A rank died, timed out or failed; the tensor-parallel group cannot go on."""


@dataclass
class HelperSpec:
    """What a helper rank needs to build its part of the engine, decided by rank 0."""

    folder: str
    dtype: str  # "float32" | "bfloat16"
    kv_dtype: str  # the KV cache's, "float32" | "bfloat16"
    device: str  # rank 0's base device; rank r uses `rank_device(device, r)`
    max_model_len: int
    num_blocks: int
    block_size: int
    num_threads: int | None
    world_size: int
    log_level: int = logging.INFO


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a replica on `cuda:K` (or `cuda`) runs on `cuda:K+r`; CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def header(cmd: int, *values: int) -> list[int]:
    return [cmd, *values] + [0] * (HEADER_LEN - 1 - len(values))


def pack_step(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
) -> tuple[list[int], torch.Tensor]:
    """The header values and the int64 payload (on the inputs' device) of one step."""
    device = input_ids.device
    parts = [input_ids, positions, meta.slot_mapping]
    width = 0
    if meta.num_decodes:
        assert meta.decode_block_tables is not None
        width = meta.decode_block_tables.shape[1]
        parts.append(meta.decode_block_tables.reshape(-1))
    rows: list[int] = []
    for chunk in meta.prefills:
        n_ctx = 0 if chunk.context_blocks is None else chunk.context_blocks.numel()
        rows += [chunk.start, chunk.end, chunk.num_computed, n_ctx]
    parts.append(torch.tensor(rows, dtype=torch.long).to(device))
    parts.extend(c.context_blocks for c in meta.prefills if c.context_blocks is not None)
    payload = torch.cat(parts)
    values = (payload.numel(), input_ids.numel(), meta.num_decodes, width, len(meta.prefills))
    return header(CMD_STEP, *values), payload


def unpack_step(
    values: list[int], payload: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Token ids, positions and attention metadata rebuilt from `pack_step`'s output."""
    _, _, t, nd, width, n_chunks = values[:6]
    input_ids, positions, slots = payload[:t], payload[t : 2 * t], payload[2 * t : 3 * t]
    off = 3 * t
    tables = mask = None
    if nd:
        tables = payload[off : off + nd * width].view(nd, width)
        off += nd * width
        padded = width * block_size
        lengths = positions[:nd] + 1  # a decode's token sits at position length - 1
        mask = torch.arange(padded, device=payload.device) < lengths.unsqueeze(1)
        mask = mask.view(nd, 1, 1, padded)
    rows = payload[off : off + 4 * n_chunks].view(n_chunks, 4).tolist()
    off += 4 * n_chunks
    chunks: list[PrefillChunk] = []
    for start, end, num_computed, n_ctx in rows:
        blocks = payload[off : off + n_ctx] if n_ctx else None
        off += n_ctx
        chunks.append(PrefillChunk(start, end, num_computed, blocks))
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_size=block_size,
        num_decodes=nd,
        decode_block_tables=tables,
        decode_mask=mask,
        prefills=chunks,
    )
    return input_ids, positions, meta
