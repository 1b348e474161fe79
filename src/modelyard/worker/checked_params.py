"""The worker's edge: turn an API request into checked engine requests, or a 400 naming the field.

This is the one place a request is checked against the model (vocabulary, context window,
caps, sampling ranges, the LoRA adapter: `EngineClient.check_request`); the engine trusts what
passes.
"""

from __future__ import annotations

from modelyard.core.errors import model_not_found
from modelyard.engine.client import (
    MAX_N,
    EngineClient,
    RequestRejected,
    SamplingParams,
    StructuredOutput,
)
from modelyard.protocol.errors import APIError, bad_request
from modelyard.protocol.openai import SamplingFields

# One API request may hold several prompts, each with n choices: this bounds their product.
MAX_CHOICES = MAX_N


def rejected(exc: RequestRejected, renames: dict[str, str] | None = None) -> APIError:
    param = exc.param and (renames or {}).get(exc.param, exc.param)
    return bad_request(str(exc), param, exc.code)


def admit(
    engine: EngineClient,
    req: SamplingFields,
    prompt: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
    structured: StructuredOutput | None = None,
    lora: str | None = None,
) -> SamplingParams:
    """The checked `SamplingParams` of one engine request of `req` over `prompt`; `structured`
    (compiled by `modelyard.worker.structured.compile_structured`) constrains its output."""
    params = SamplingParams(
        n=req.n,
        max_tokens=max_tokens or engine.default_max_tokens(len(prompt)),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty or 1.0,
        seed=req.seed,
        stop=req.stop_list(),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        structured=structured,
        lora=lora,
        logit_bias=req.logit_bias_items(),
    )
    try:
        engine.check_request(prompt, params, req.priority, prompt_param)
    except RequestRejected as exc:
        if exc.code == "model_not_found":  # no such adapter here: as for any unknown model
            raise APIError.from_domain(model_not_found(req.model)) from exc
        # The completions API names its top-logprob count `logprobs`.
        renames = {"top_logprobs": "logprobs"} if prompt_param == "prompt" else None
        raise rejected(exc, renames) from exc
    return params


def check_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise bad_request(
            f"{num_prompts} prompts with n={n} ask for {num_prompts * n} choices; "
            f"at most {MAX_CHOICES} are allowed per request",
            "n",
            "invalid_value",
        )
