"""OpenAI chat and text completions over the `AsyncEngine`: prompts in, JSON or SSE out.

This module turns the API request into engine requests, checked once, here, before anything
is queued (`modelyard.worker.admission`), and builds the API's response shapes; running the
engine requests and streaming their outputs is `modelyard.worker.fanout`'s job.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request

from modelyard.core.errors import model_not_found
from modelyard.engine.async_engine import AsyncEngine
from modelyard.engine.sequence import TokenLogprob
from modelyard.engine.tokenizer import ChatTemplateError
from modelyard.protocol.disconnect import run_until_disconnect
from modelyard.protocol.errors import APIError, bad_request
from modelyard.protocol.openai import ChatCompletionRequest, CompletionRequest, SamplingFields
from modelyard.protocol.responses import JSONResponse
from modelyard.worker.admission import admit, check_choices
from modelyard.worker.fanout import FanOut, streaming_response
from modelyard.worker.logprobs import chat_logprobs, completion_logprobs
from modelyard.worker.metrics import WorkerMetrics

MAX_PROMPTS = 64


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.tokenizer = engine.engine.tokenizer
        self.fanout = FanOut(engine, metrics)
        self.created = int(time.time())

    # ----- shared ----------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "modelyard",
                    "max_model_len": self.engine.engine.max_model_len,
                }
            ],
        }

    def _check_model(self, req: SamplingFields, unsupported: str | None) -> None:
        if req.model != self.model_name:
            raise APIError.from_domain(model_not_found(req.model))
        if unsupported:
            raise bad_request(
                f"'{unsupported}' is not supported by this server.", unsupported, "unsupported"
            )

    # ----- chat ------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Any:
        self._check_model(req, req.unsupported())
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = self.tokenizer.encode_chat(messages)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages", "invalid_messages") from exc
        k = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = admit(self.engine.engine, req, prompt, max_tokens, k, "messages")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        jobs = [(prompt, params)]
        created = int(time.time())
        response_id = f"chatcmpl-{request_id}"

        if req.stream:
            base = {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
            }

            def role_chunk(i: int) -> dict[str, Any]:
                return {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }

            def choice_chunk(
                i: int, text: str, lps: list[TokenLogprob], reason: str | None
            ) -> dict[str, Any]:
                return {
                    "index": i,
                    "delta": {"content": text} if text else {},
                    "logprobs": chat_logprobs(self.tokenizer, lps)
                    if k is not None and lps
                    else None,
                    "finish_reason": reason,
                }

            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self.fanout.stream(
                request_id, jobs, req, include_usage, base, role_chunk, choice_chunk
            )
            return streaming_response(body, request_id, len(prompt))

        choices, usage = await run_until_disconnect(
            request, self.fanout.collect(request_id, jobs, req)
        )
        return JSONResponse(
            {
                "id": response_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": "".join(c.text)},
                        "logprobs": chat_logprobs(self.tokenizer, c.logprobs)
                        if k is not None
                        else None,
                        "finish_reason": c.finish_reason,
                    }
                    for i, c in sorted(choices.items())
                ],
                "usage": usage.as_dict(),
            },
            headers={"x-request-id": request_id},
        )

    # ----- completions -----------------------------------------------------------------------

    def _prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]  # type: ignore[arg-type]
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompts = [self.tokenizer.encode(p) for p in prompt]  # type: ignore[arg-type]
        elif prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]  # type: ignore[arg-type]
        else:
            raise bad_request("prompt must be a string, a list of strings or token ids", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
        return prompts

    async def completion(self, req: CompletionRequest, request: Request) -> Any:
        self._check_model(req, req.unsupported())
        prompts = self._prompts(req.prompt)
        check_choices(len(prompts), req.n)
        engine = self.engine.engine
        jobs = [(p, admit(engine, req, p, req.max_tokens, req.logprobs, "prompt")) for p in prompts]
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        created = int(time.time())
        response_id = f"cmpl-{request_id}"
        k = req.logprobs

        if req.stream:
            base = {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
            }

            def choice_chunk(
                i: int, text: str, lps: list[TokenLogprob], reason: str | None
            ) -> dict[str, Any]:
                return {
                    "index": i,
                    "text": text,
                    "logprobs": completion_logprobs(self.tokenizer, lps)
                    if k is not None and lps
                    else None,
                    "finish_reason": reason,
                }

            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self.fanout.stream(
                request_id, jobs, req, include_usage, base, None, choice_chunk
            )
            return streaming_response(body, request_id, sum(len(p) for p in prompts))

        choices, usage = await run_until_disconnect(
            request, self.fanout.collect(request_id, jobs, req)
        )
        return JSONResponse(
            {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": i,
                        "text": "".join(c.text),
                        "logprobs": completion_logprobs(self.tokenizer, c.logprobs)
                        if k is not None
                        else None,
                        "finish_reason": c.finish_reason,
                    }
                    for i, c in sorted(choices.items())
                ],
                "usage": usage.as_dict(),
            },
            headers={"x-request-id": request_id},
        )
