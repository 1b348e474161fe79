"""Request checks: the one check that a request can run on this engine, done before it is queued.

`check_request` holds every rule a step relies on (token ids inside the vocabulary, sampling
values in range for this model, the prompt and `max_tokens` inside the context window, the
cap and the KV cache, a known priority). The worker calls it once per engine request at its
edge; the engine itself trusts what it is given, and a step that fails anyway fails only the
requests it held (see `LLMEngine.step`).
"""

from __future__ import annotations

from dataclasses import dataclass

from modelyard.engine.kv_cache_manager import blocks_for
from modelyard.engine.sampling_params import InvalidSamplingParams, SamplingParams

MAX_PRIORITY = 9  # 0 is served first; the gateway maps tenant tiers and batch onto 0..5


class RequestRejected(ValueError):
    """A request that can never run on this engine (too long, empty, bad token ids, bad
    sampling values); `param` names the field for the API error, `code` says which rule."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_model_len: int
    max_tokens_cap: int
    block_size: int
    num_blocks: int

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size


def check_prompt(limits: EngineLimits, prompt_token_ids: list[int], param: str = "prompt") -> None:
    if not prompt_token_ids:
        raise RequestRejected("the prompt is empty", param, "invalid_prompt")
    vocab = limits.vocab_size
    if any(t < 0 or t >= vocab for t in prompt_token_ids):
        raise RequestRejected(f"token ids must be in [0, {vocab})", param, "invalid_prompt")


def check_lengths(
    limits: EngineLimits, n: int, params: SamplingParams, prompt_param: str = "messages"
) -> None:
    if params.max_tokens > limits.max_tokens_cap:
        raise RequestRejected(
            f"max_tokens is {params.max_tokens}, above this server's cap of "
            f"{limits.max_tokens_cap}",
            "max_tokens",
            "context_length_exceeded",
        )
    if n + params.max_tokens > limits.max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"you requested {n + params.max_tokens} tokens ({n} in the messages, "
            f"{params.max_tokens} in the completion). Please reduce the length of the "
            "messages or completion.",
            prompt_param,
            "context_length_exceeded",
        )
    if blocks_for(n + params.max_tokens, limits.block_size) > limits.num_blocks:
        raise RequestRejected(
            f"the request needs {n + params.max_tokens} tokens of KV cache but this replica "
            f"holds at most {limits.token_capacity}; reduce the prompt or max_tokens",
            "max_tokens",
            "context_length_exceeded",
        )


def check_request(
    limits: EngineLimits,
    prompt_token_ids: list[int],
    params: SamplingParams,
    priority: int = 0,
    prompt_param: str = "prompt",
) -> None:
    """Raise `RequestRejected` for a request that can never be served by this engine."""
    try:
        params.validate(limits.vocab_size)
    except InvalidSamplingParams as exc:
        raise RequestRejected(str(exc), exc.param) from exc
    if not 0 <= priority <= MAX_PRIORITY:
        raise RequestRejected(f"priority must be between 0 and {MAX_PRIORITY}", "priority")
    check_prompt(limits, prompt_token_ids, prompt_param)
    check_lengths(limits, len(prompt_token_ids), params, prompt_param)
