"""`EngineSettings`: the knobs of the LLM engine and of the worker process that serves it (a
deploy body's `engine` block; `MODELYARD_<NAME>` in a worker's environment)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from modelyard.config.sources import SettingsBase, parse_size

# The engine serves lower priorities first: interactive requests get their tenant tier's rank
# (0 priority, 1 standard, 2 free), batch items this plus the rank, after all interactive ones.
# The engine treats this priority and every less urgent one as backfill (`backfill_step_slowdown`).
BATCH_PRIORITY = 3


class EngineSettings(SettingsBase):
    """Knobs of the LLM engine and of the worker process that serves it."""

    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Weights and activations; auto = bfloat16 on CUDA and on CPUs with native "
        "bfloat16 (AVX512-BF16, AMX), else float32 (and float32 with quantization w8a8).",
    )
    device: str = Field("auto", description="torch device for the engine: auto, cpu, cuda, cuda:N.")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Element type of the KV cache; auto = the model's dtype, except under int8 "
        "weights on a CPU where a bfloat16 cache measured faster than a float32 one "
        "(engine/defaults.py). bfloat16 under a float32 model halves the cache's memory and "
        "the bytes decode attention reads (as llama.cpp's default f16 cache does), at "
        "bfloat16's rounding of keys and values.",
    )
    kv_cache_memory: int = Field(
        parse_size("1GiB"), description="Memory budget for the paged KV cache (e.g. 1GiB)."
    )
    kv_swap_memory: int = Field(
        parse_size("256MiB"),
        ge=0,
        description="Host-memory pool (per replica, pinned on CUDA) that keeps the KV blocks of "
        "sequences preempted by swap until they resume (e.g. 256MiB), at most 4 times the "
        "KV cache's blocks whatever is set; 0 = no pool, preempted sequences are always "
        "recomputed.",
    )
    preemption_mode: Literal["auto", "swap", "recompute"] = Field(
        "auto",
        description="How a sequence preempted for a more urgent one comes back: swap (its KV "
        "blocks copied to the kv_swap_memory pool and back), recompute (its prompt and output "
        "so far computed again), or auto: swap when the engine's measured copy cost is below "
        "its measured prefill cost for that length; swap falls back to recompute when the pool "
        "is full. Not with tensor_parallel_size > 1 (always recompute; swap is refused).",
    )
    backfill_step_slowdown: float = Field(
        0.1,
        ge=0,
        description="Backfill (batch items) beside real-time work: a step that decodes "
        "real-time sequences carries only as many batch tokens as keep it within this fraction "
        "of its time without them, by the engine's measured step cost (0 = none while "
        "real-time sequences run; never for more than 2 s: then one step carries batch all the "
        "same); while real-time work ran in the last 30 s a step of batch "
        "work alone takes at most twice max_num_seqs tokens, so that a real-time request "
        "arriving meanwhile waits for about one decode step.",
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV cache block.")
    max_num_seqs: int = Field(64, ge=1, description="Most sequences running in one engine step.")
    max_num_batched_tokens: int = Field(
        512, ge=16, description="Token budget of one engine step (prefill chunks + decodes)."
    )
    max_model_len: int | None = Field(
        None, description="Longest context (prompt + output); default: the model's own limit."
    )
    enable_prefix_caching: bool = True
    max_tokens_cap: int = Field(4096, ge=1, description="Server hard cap on generated tokens.")
    request_timeout_s: float = Field(120.0, gt=0, description="Wall-clock limit of one request.")
    no_progress_timeout_s: float = Field(
        30.0, gt=0, description="Abort a request that produced no output for this long."
    )
    cache_dir: Path = Field(
        Path.home() / ".cache" / "modelyard",
        description="Where converted weights (GGUF to safetensors) and tokenizers are cached.",
    )
    num_threads: int | None = Field(
        None,
        description="torch intra-op threads per rank (default: a worker on CPU takes every "
        "core but one, which its HTTP server keeps; with tensor parallelism on CPU, the cores "
        "divided by tensor_parallel_size; an engine used in-process, torch's).",
    )
    cpu_kernels: bool = Field(
        True,
        description="On CPU, decode attention and the small per-layer ops (RMSNorm, RoPE with "
        "the KV-cache write, w8a8's activation scaling) run in modelyard's C kernels, compiled "
        "on first use with the machine's C compiler (cc, gcc or $CC) into cache_dir/kernels; "
        "false, or no compiler, keeps PyTorch's ops (slower).",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks (devices) one replica's model is split over; each rank gets "
        "kv_cache_memory for its share of the KV heads.",
    )
    quantization: Literal["auto", "none", "int8", "w8a8", "gguf", "gguf+w8a8"] = Field(
        "auto",
        description="Quantization of the linear layers and embedding: int8 = weight-only "
        "per-output-channel int8 (~26 % of float32 weight memory); w8a8 = int8 weights and "
        "per-token int8 activations after SmoothQuant calibration (FBGEMM; x86 CPUs, float32; "
        "1.7-3.5x float32's tokens/s on AVX2, less accurate, ~56 % of float32 memory); "
        "gguf = a GGUF file's Q4_0/Q4_1/Q8_0 blocks kept as they are, read in place by the C "
        "matmul against int8 activations (its other matrices stay float; CPU, float32); "
        "gguf+w8a8 = those blocks for matmuls of 1-4 rows (decode steps of up to four "
        "sequences, in one C call) and a w8a8 copy of each for wider ones (prefill, larger "
        "batches): both in memory; "
        "none = the file's weights dequantized to the model's dtype; auto = the fastest int8 "
        "mode this CPU runs for a quantized GGUF file, none for float files (defaults.py). "
        "Python's None means none.",
    )
    max_loras: int = Field(
        0, ge=0, description="LoRA adapter slots held at once (LRU); 0 = no LoRA serving."
    )
    max_lora_rank: int = Field(16, ge=1, description="Largest LoRA rank a slot takes.")
    lora_weight_dtype: Literal["auto", "int8", "float16", "bfloat16", "float32"] = Field(
        "auto",
        description="How the LoRA slots keep adapter weights: int8 = each weight row symmetric "
        "int8 with one float32 scale (a quarter of float32's bytes: a decode step of many "
        "adapters is bound by reading them; on CPUs with AVX-512 VNNI the C kernel multiplies "
        "them in int8, quantizing each row's activations as w8a8 does); auto = int8 where the "
        "base model is quantized (any quantization but none) and the C kernels (cpu_kernels) "
        "multiply int8 so, else float16 for a float32 model on a CPU (products and sums in "
        "float32) and the model's dtype elsewhere. An explicit int8 works everywhere "
        "(elsewhere widened to floats, or dequantized by PyTorch as it gathers).",
    )
    speculative: Literal["off", "ngram", "draft"] = Field(
        "off",
        description="Speculative decoding: ngram = prompt lookup: a decoding sequence whose "
        "last tokens occurred earlier in its prompt or output drafts the tokens that followed; "
        "draft = a smaller model of the same tokenizer (speculative_model), loaded in the same "
        "worker with its own KV cache, drafts them. Either way the drafts are verified in one "
        "step (greedy output unchanged, sampling distribution preserved); not for requests "
        "with penalties, logprobs or structured output. Off by default: ngram pays on output "
        "that copies its input (summaries, edits, code) and costs a little elsewhere; draft "
        "pays only where the draft is much cheaper than the model and agrees with it often "
        "(BENCHMARKS.md).",
    )
    speculative_model: str | None = Field(
        None,
        description="The draft model of speculative=draft: a Hugging Face folder, a .gguf "
        "file or a bundled name (smollm2), with the model's vocabulary and tokenizer.",
    )
    num_speculative_tokens: int = Field(
        4, ge=1, le=16, description="Most draft tokens verified per sequence and step."
    )
    prompt_lookup_min: int = Field(
        2,
        ge=1,
        le=16,
        description="Shortest suffix n-gram looked up for a draft (speculative=ngram).",
    )
    prompt_lookup_max: int = Field(
        4,
        ge=1,
        le=16,
        description="Longest suffix n-gram looked up for a draft (speculative=ngram).",
    )
    lora_dir: Path | None = Field(
        None,
        description="Folder of PEFT adapters (one subfolder per adapter name) a request may "
        "name as `<model>:<adapter>`.",
    )
    lora_registry_dir: Path | None = Field(
        None,
        description="Set by the platform, never in a deploy body: the node-cache folder of the "
        "registry adapters pushed against this endpoint's base model (one per adapter name).",
    )

    @model_validator(mode="after")
    def _lookup_range(self) -> EngineSettings:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        if self.speculative == "draft" and not self.speculative_model:
            raise ValueError("speculative=draft needs speculative_model (the draft model)")
        if self.speculative_model and self.speculative != "draft":
            raise ValueError("speculative_model is used only with speculative=draft")
        return self

    @field_validator("quantization", mode="before")
    @classmethod
    def _none_is_unquantized(cls, value: Any) -> Any:
        return "none" if value is None else value

    @field_validator("kv_cache_memory", "kv_swap_memory", mode="before")
    @classmethod
    def _parse_size(cls, value: Any) -> int:
        return parse_size(value)
