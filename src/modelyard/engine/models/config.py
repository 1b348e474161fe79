"""`ModelConfig`: the architecture numbers of a Llama-family model (`MoeConfig`: its experts, for
the mixture-of-experts ones), read from a HF config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
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
class MoeConfig:
    """A mixture-of-experts MLP: each token's `top_k` experts by softmax router probability."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    norm_topk_prob: bool  # renormalise the chosen experts' probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0: none
    dense_layers: frozenset[int] = frozenset()  # layers with the dense MLP instead

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> MoeConfig | None:
        """The MoE numbers of a `mixtral`, `qwen2_moe` or `olmoe` config; None for the others."""
        model_type = cfg.get("model_type")
        if model_type == "mixtral":
            moe = cls(
                num_experts=cfg.get("num_local_experts", 8),
                top_k=cfg.get("num_experts_per_tok", 2),
                intermediate_size=cfg["intermediate_size"],
                norm_topk_prob=True,
            )
        elif model_type == "olmoe":
            if cfg.get("clip_qkv") is not None:
                raise UnsupportedModelError("olmoe with clip_qkv is not supported")
            if cfg.get("attention_bias"):
                raise UnsupportedModelError("olmoe with attention_bias is not supported")
            moe = cls(
                num_experts=cfg.get("num_experts", 64),
                top_k=cfg.get("num_experts_per_tok", 8),
                intermediate_size=cfg["intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            )
        elif model_type == "qwen2_moe":
            step = cfg.get("decoder_sparse_step", 1)
            if not isinstance(step, int) or step < 1:
                raise UnsupportedModelError(
                    f"qwen2_moe decoder_sparse_step={step!r} is not supported (a positive integer)"
                )
            mlp_only = cfg.get("mlp_only_layers") or []
            layers = range(cfg["num_hidden_layers"])
            moe = cls(
                num_experts=cfg.get("num_experts", 60),
                top_k=cfg.get("num_experts_per_tok", 4),
                intermediate_size=cfg.get("moe_intermediate_size", 1408),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 5632),
                dense_layers=frozenset(i for i in layers if i in mlp_only or (i + 1) % step),
            )
        else:
            return None
        if not 1 <= moe.top_k <= moe.num_experts:
            raise UnsupportedModelError(
                f"{model_type} with num_experts_per_tok={moe.top_k} and {moe.num_experts} "
                "experts is not supported"
            )
        return moe


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
    qk_norm_whole: bool = False  # OLMoE: q/k RMSNorm over all heads at once, not per head
    moe: MoeConfig | None = None
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
            # Qwen2 has q/k/v biases without saying so in its config, Qwen2-MoE as `qkv_bias`.
            attention_bias=bool(
                cfg.get("qkv_bias", True)
                if model_type == "qwen2_moe"
                else cfg.get("attention_bias", model_type == "qwen2")
            ),
            qk_norm=model_type in ("qwen3", "olmoe"),
            qk_norm_whole=model_type == "olmoe",
            moe=MoeConfig.from_hf_dict(cfg),
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
