"""A tiny random Llama as a GGUF file with quantized tensors (the types chosen per tensor), and
its Hugging Face folder as the engine's converter makes it (config and dequantized weights; no
tokenizer: the tests feed token ids)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS, VOCAB = 64, 4, 2, 96, 2, 512


def build_gguf(path: Path, types: dict[str, int], seed: int = 0) -> Path:
    """Write the model to `path`: `types` maps a tensor's name (`blk.1.attn_v.weight`) or its
    part (`attn_q`, `ffn_down`, `token_embd`, ...) to its GGML type (F32 where neither is
    named); tied LM head."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    head_dim = HIDDEN // HEADS

    def tensor(name: str, part: str, rows: int, cols: int, scale: float) -> None:
        w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        kind = gguf.GGMLQuantizationType(types.get(name, types.get(part, 0)))  # 0: F32
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)

    tensor("token_embd.weight", "token_embd", VOCAB, HIDDEN, 1.0)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        tensor(p + "attn_q.weight", "attn_q", HEADS * head_dim, HIDDEN, 0.15)
        tensor(p + "attn_k.weight", "attn_k", KV_HEADS * head_dim, HIDDEN, 0.15)
        tensor(p + "attn_v.weight", "attn_v", KV_HEADS * head_dim, HIDDEN, 0.15)
        tensor(p + "attn_output.weight", "attn_output", HIDDEN, HEADS * head_dim, 0.15)
        tensor(p + "ffn_gate.weight", "ffn_gate", INTERMEDIATE, HIDDEN, 0.15)
        tensor(p + "ffn_up.weight", "ffn_up", INTERMEDIATE, HIDDEN, 0.15)
        tensor(p + "ffn_down.weight", "ffn_down", HIDDEN, INTERMEDIATE, 0.15)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_folder(gguf_path: Path, folder: Path) -> Path:
    """The folder the engine's converter would make of `gguf_path`, less the tokenizer."""
    import json

    import gguf
    from safetensors.torch import save_file

    from modelyard.engine.models import gguf_convert

    reader = gguf.GGUFReader(str(gguf_path))
    cfg = gguf_convert._hf_config(reader)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(gguf_convert._state_dict(reader, cfg), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder
