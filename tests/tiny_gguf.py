"""A tiny random Llama written as a GGUF file on the fly, its matrices stored in a quantized type
(Q8_0, Q4_0, Q4_1, ...) or F32, its byte-level BPE tokenizer and chat template in the metadata,
as llama.cpp's converter lays them out (Q and K rows permuted for the rotary halves)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.tiny_models import CHAT_TEMPLATE, build_model

_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (the inverse of `gguf_convert._unpermute`)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    base, _, kind = hf.rpartition(".")
    if base.startswith("model.layers."):
        layer, part = base.removeprefix("model.layers.").split(".", 1)
        return f"blk.{layer}.{_LAYER[part]}.{kind}"
    return f"{_GLOBAL[base]}.{kind}"


def build_gguf(
    path: Path, weight_type: str = "Q8_0", seed: int = 0, folder: Path | None = None
) -> Path:
    """Write a tiny Llama (hidden 64, 2 layers, 4 heads, 2 KV heads) to `path` as a GGUF file;
    `folder`: the Hugging Face Llama (`tiny_models.build_model`) to write instead of a new one."""
    import gguf
    from safetensors.numpy import load_file

    folder = folder or build_model(path.parent / f"{path.stem}-hf", "llama", seed=seed)
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    special = {a["content"]: a["id"] for a in tok["added_tokens"]}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(special["<|im_start|>"])
    writer.add_eos_token_id(special["<|im_end|>"])
    writer.add_chat_template(CHAT_TEMPLATE)
    qtype = gguf.GGMLQuantizationType[weight_type]
    state = load_file(str(folder / "model.safetensors"))
    for name, tensor in sorted(state.items()):
        w = tensor.astype(np.float32)
        if name.endswith("q_proj.weight"):
            w = _permute(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _permute(w, cfg["num_key_value_heads"])
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
