"""`ModelConfig`: the architecture numbers of a Llama-family model, read from a HF config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedModelError(ValueError):
    """The model's architecture or a feature of it is not implemented by the engine."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (`rope_type: llama3`); `linear` scales positions."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported by the engine (supported: {supported})"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported")
        heads = cfg["num_attention_heads"]
        rope_theta = cfg.get("rope_theta")
        rope_raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_raw.get("rope_theta", 10000.0)
        rope_type = rope_raw.get("rope_type", rope_raw.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported")
        rope = RopeScaling(
            rope_type=rope_type,
            factor=float(rope_raw.get("factor", 1.0)),
            low_freq_factor=float(rope_raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope_raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope_raw.get("original_max_position_embeddings", 8192)
            ),
        )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            # Without sliding-window attention the engine is exact only up to the window.
            sliding_window=cfg.get("sliding_window")
            if cfg.get("use_sliding_window", True)
            else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes
