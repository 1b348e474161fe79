"""Convert a GGUF file into a Hugging Face folder (config.json, safetensors, tokenizer) once.

Dequantizing GGUF tensors and rebuilding its tokenizer takes seconds; the converted folder is
cached under `cache_dir/converted/<sha256 of the file>` and written atomically, so later loads
are a safetensors mmap and a tokenizer.json read. Its `source.json` names the file and the GGUF
types its weights were stored in (`gguf_weight_type`: what `engine/defaults.py` decides by).

The tokenizer is transformers' rebuild of the file's vocabulary, plus the splitting it has no
mapping for: a GGUF names its pre-tokenizer (`tokenizer.ggml.pre`), and for `smollm` (SmolLM
and SmolLM2) every digit is its own piece before the byte-level split, as in the model's own
tokenizer and llama.cpp's. Without it "  135M" came out as other tokens than the model was
trained on. A folder converted before that (`source.json` without `conversion` 2) has its
tokenizer fixed in place on its next load.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modelyard.engine.models.config import UnsupportedModelError

log = logging.getLogger(__name__)

CONVERSION = 2  # 2: the GGUF's pre-tokenizer applied (`_pre_tokenizer`)
_ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}
# llama.cpp's converter interleaves the rotary halves of Q and K for these architectures only.
PERMUTED_QK_ARCHS = {"llama", "mistral"}

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def file_sha256(path: Path) -> str:
    """The file's SHA-256, hashed once per version of the file in this process (a load looks
    its conversion up twice: once to choose the numerics, once to load; a GGUF is gigabytes)."""
    st = path.stat()
    return _sha256_of(path.resolve(), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=64)
def _sha256_of(path: Path, size: int, mtime_ns: int, inode: int) -> str:
    """`path`'s hash; size, mtime and inode are the cache key (a rewritten file is hashed anew)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _hf_config(reader: Any) -> dict[str, Any]:
    arch = field(reader, "general.architecture")
    if arch not in _ARCH_TO_MODEL_TYPE:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported")

    def get(key: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{key}", default)

    if get("expert_count"):  # Mixtral's GGUF says "llama": its experts are not converted
        raise UnsupportedModelError(
            "GGUF mixture-of-experts models are not supported; use the Hugging Face folder"
        )
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(field(reader, "tokenizer.ggml.tokens"))
    cfg: dict[str, Any] = {
        "architectures": [f"{arch.capitalize()}ForCausalLM"],
        "model_type": _ARCH_TO_MODEL_TYPE[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    return cfg


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation back to Hugging Face's rotate-half layout."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        mapped = _LAYER_TENSORS.get(part)
        return f"model.layers.{layer}.{mapped}.{kind}" if mapped else None
    mapped = _GLOBAL_TENSORS.get(base)
    return f"{mapped}.{kind}" if mapped else None


def _state_dict(reader: Any, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    arch = field(reader, "general.architecture")
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            log.info("skipping GGUF tensor %s", t.name)
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if arch in PERMUTED_QK_ARCHS and name.endswith("q_proj.weight"):
            w = unpermute(w, cfg["num_attention_heads"])
        elif arch in PERMUTED_QK_ARCHS and name.endswith("k_proj.weight"):
            w = unpermute(w, cfg["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
    return tensors


def _chat_template(reader: Any) -> str | None:
    template = field(reader, "tokenizer.chat_template")
    return str(template) if template else None


def _pre_tokenizer(reader: Any, current: Any) -> Any:
    """The pre-tokenizer the file's `tokenizer.ggml.pre` names, where transformers' rebuild
    (`current`) lacks it; None where it has nothing to add."""
    from tokenizers import pre_tokenizers

    if field(reader, "tokenizer.ggml.pre") != "smollm":
        return None
    digits = pre_tokenizers.Digits(individual_digits=True)
    return pre_tokenizers.Sequence([digits, current] if current is not None else [digits])


def _fix_tokenizer(gguf_path: Path, folder: Path) -> None:
    """Bring a folder converted before `CONVERSION` 2 up to it: its tokenizer.json gets the
    file's pre-tokenizer (each file replaced whole, so a concurrent reader sees old or new)."""
    source = folder / "source.json"
    record = json.loads(source.read_text()) if source.exists() else {}
    if record.get("conversion", 1) >= CONVERSION:
        return
    import gguf
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if path.exists():
        tokenizer = Tokenizer.from_file(str(path))
        fixed = _pre_tokenizer(gguf.GGUFReader(str(gguf_path)), tokenizer.pre_tokenizer)
        if fixed is not None:
            log.info("%s: the tokenizer now splits as the GGUF's pre-tokenizer says", folder)
            tokenizer.pre_tokenizer = fixed
            tmp = folder / f".tokenizer.json.{os.getpid()}"
            tokenizer.save(str(tmp))
            os.replace(tmp, path)
    tmp = folder / f".source.json.{os.getpid()}"
    tmp.write_text(json.dumps({**record, "conversion": CONVERSION}))
    os.replace(tmp, source)


def _weight_types(reader: Any) -> dict[str, int]:
    """Elements of the file's matrices (2-D and up) per GGUF tensor type, e.g. {"Q4_1": ...}."""
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) >= 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    return counts


def gguf_weight_type(gguf_path: Path, folder: Path) -> str:
    """The GGUF type most of `gguf_path`'s weights are stored in ("Q4_1", "F16", ...), as its
    conversion `folder` recorded it (a folder converted before that was recorded is given it)."""
    source = folder / "source.json"
    record = json.loads(source.read_text()) if source.exists() else {}
    counts = record.get("weight_types")
    if not isinstance(counts, dict) or not counts:
        import gguf

        counts = _weight_types(gguf.GGUFReader(str(gguf_path)))
        record = {"gguf": str(gguf_path.resolve()), **record, "weight_types": counts}
        tmp = folder / f".source.json.{os.getpid()}"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, source)
    return str(max(counts, key=lambda name: counts[name])) if counts else "F32"


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Return a HF folder equivalent to `gguf_path`, converting it on first use."""
    gguf_path = gguf_path.resolve()
    target = cache_dir / "converted" / file_sha256(gguf_path)
    if (target / "config.json").exists():
        _fix_tokenizer(gguf_path, target)
        return target
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    log.info("converting %s into %s (first load of this file)", gguf_path, target)
    reader = gguf.GGUFReader(str(gguf_path))
    cfg = _hf_config(reader)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        save_file(_state_dict(reader, cfg), str(tmp / "model.safetensors"))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        backend = tokenizer.backend_tokenizer
        fixed = _pre_tokenizer(reader, backend.pre_tokenizer)
        if fixed is not None:
            backend.pre_tokenizer = fixed
        template = _chat_template(reader)
        if template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = template
        tokenizer.save_pretrained(str(tmp))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        source = {
            "gguf": str(gguf_path),
            "weight_types": _weight_types(reader),
            "conversion": CONVERSION,
        }
        (tmp / "source.json").write_text(json.dumps(source))
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process converted the same file first; its result is identical.
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
