"""OpenAI chat and text completions over the `AsyncEngine`: prompts in, JSON or SSE out.

One API request may fan out into several engine requests (a list of prompts); their outputs
merge into one stream whose choice index is `prompt_index * n + sequence_index`. Each is
checked once, here, before anything is queued (`modelyard.worker.admission`).

Streams carry usage as OpenAI does: only in one last chunk with empty `choices`, and only
when `stream_options.include_usage` asks for it (the gateway always asks, to bill).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from modelyard.engine.async_engine import AsyncEngine, EngineDeadError, RequestTimeout
from modelyard.engine.faults import RequestFailed
from modelyard.engine.llm_engine import RequestOutput
from modelyard.engine.sampling_params import SamplingParams
from modelyard.engine.sequence import TokenLogprob
from modelyard.engine.tokenizer import ChatTemplateError
from modelyard.protocol.disconnect import run_until_disconnect
from modelyard.protocol.errors import APIError, bad_request, error_body
from modelyard.protocol.openai import (
    PROMPT_TOKENS_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
)
from modelyard.protocol.responses import JSONResponse
from modelyard.protocol.sse import DONE, sse_data
from modelyard.worker.admission import admit, check_choices
from modelyard.worker.metrics import RequestTimer, WorkerMetrics

MAX_PROMPTS = 64


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0


@dataclass
class _Usage:
    prompt: dict[int, int] = field(default_factory=dict)  # per engine request
    cached: dict[int, int] = field(default_factory=dict)
    completion: dict[int, int] = field(default_factory=dict)

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        self.prompt[prompt_index] = out.prompt_tokens
        self.cached[prompt_index] = out.cached_tokens
        self.completion[prompt_index] = out.completion_tokens

    def as_dict(self) -> dict[str, Any]:
        prompt, completion = sum(self.prompt.values()), sum(self.completion.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.tokenizer = engine.engine.tokenizer
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

    def _check_model(self, req: _SamplingFields, unsupported: str | None) -> None:
        if req.model != self.model_name:
            raise APIError(
                404,
                f"The model `{req.model}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        if unsupported:
            raise bad_request(
                f"'{unsupported}' is not supported by this server.", unsupported, "unsupported"
            )

    async def _merged(
        self, request_id: str, jobs: list[tuple[list[int], SamplingParams]], req: _SamplingFields
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every engine request of this API request, as they come."""
        priority, salt = req.priority, req.cache_salt
        # A client's x-request-id need not be unique; the engine's ids must be.
        request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        if len(jobs) == 1:
            async for out in self.engine.generate(
                jobs[0][0], jobs[0][1], request_id, priority, salt
            ):
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, prompt: list[int], params: SamplingParams) -> None:
            try:
                async for out in self.engine.generate(
                    prompt, params, f"{request_id}-{i}", priority, salt
                ):
                    await queue.put((i, out))
                await queue.put((i, None))
            except BaseException as exc:
                await queue.put((i, exc))
                raise

        tasks = [asyncio.create_task(pump(i, p, s)) for i, (p, s) in enumerate(jobs)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _stream_error(exc: BaseException) -> dict[str, Any]:
        if isinstance(exc, RequestTimeout):
            return error_body(str(exc), "timeout_error", None, exc.code)
        return error_body(f"generation failed: {exc}", "server_error", None, "engine_error")

    @staticmethod
    def _raise_for(exc: BaseException) -> None:
        if isinstance(exc, RequestTimeout):
            raise APIError(504, str(exc), code=exc.code) from exc
        if isinstance(exc, EngineDeadError):
            raise APIError(503, str(exc), code="engine_unavailable") from exc
        raise APIError(500, str(exc), code="engine_error") from exc

    async def _collect(
        self,
        request_id: str,
        jobs: list[tuple[list[int], SamplingParams]],
        req: _SamplingFields,
    ) -> tuple[dict[int, _Choice], _Usage]:
        timer = RequestTimer(self.metrics)
        choices: dict[int, _Choice] = {}
        usage = _Usage()
        try:
            async for pi, out in self._merged(request_id, jobs, req):
                usage.add(pi, out)
                if any(d.token_ids for d in out.deltas):
                    timer.tokens()
                for d in out.deltas:
                    c = choices.setdefault(pi * req.n + d.index, _Choice())
                    c.text.append(d.text)
                    c.logprobs.extend(d.logprobs)
                    c.num_tokens += len(d.token_ids)
                    if d.finish_reason is not None:
                        c.finish_reason = d.finish_reason.value
        except (RequestTimeout, EngineDeadError, RequestFailed) as exc:
            self._raise_for(exc)
        timer.done()
        return choices, usage

    def _streaming_response(
        self, body: AsyncIterator[bytes], request_id: str, prompt_tokens: int
    ) -> StreamingResponse:
        return StreamingResponse(
            body,
            media_type="text/event-stream",
            headers={
                "cache-control": "no-cache",
                "x-accel-buffering": "no",
                "x-request-id": request_id,
                # Lets a metering proxy bill the prompt of a stream its client abandons.
                PROMPT_TOKENS_HEADER: str(prompt_tokens),
            },
        )

    async def _stream(
        self,
        request_id: str,
        jobs: list[tuple[list[int], SamplingParams]],
        req: _SamplingFields,
        include_usage: bool,
        base: dict[str, Any],
        role_chunk: Callable[[int], dict[str, Any]] | None,
        choice_chunk: Callable[[int, str, list[TokenLogprob], str | None], dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        timer = RequestTimer(self.metrics)
        usage = _Usage()
        try:
            if role_chunk is not None:
                for i in range(len(jobs) * req.n):
                    yield sse_data({**base, "choices": [role_chunk(i)]})
            async for pi, out in self._merged(request_id, jobs, req):
                usage.add(pi, out)
                if any(d.token_ids for d in out.deltas):
                    timer.tokens()
                for d in out.deltas:
                    index = pi * req.n + d.index
                    if d.text or d.logprobs:
                        chunk = choice_chunk(index, d.text, d.logprobs, None)
                        yield sse_data({**base, "choices": [chunk]})
                    if d.finish_reason is None:
                        continue
                    # The finish gets a chunk of its own with an empty delta, as OpenAI sends it;
                    # usage never rides on it (clients that add up usage chunks count once).
                    reason = d.finish_reason
                    yield sse_data({**base, "choices": [choice_chunk(index, "", [], reason)]})
            if include_usage:
                yield sse_data({**base, "choices": [], "usage": usage.as_dict()})
            timer.done()
        except (RequestTimeout, EngineDeadError, RequestFailed) as exc:
            yield sse_data(self._stream_error(exc))
        yield DONE

    # ----- chat ------------------------------------------------------------------------------

    def _chat_logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.tokenizer.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in logprobs
            ]
        }

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
                    "logprobs": self._chat_logprobs(lps) if k is not None and lps else None,
                    "finish_reason": reason,
                }

            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(
                request_id, jobs, req, include_usage, base, role_chunk, choice_chunk
            )
            return self._streaming_response(body, request_id, len(prompt))

        choices, usage = await run_until_disconnect(request, self._collect(request_id, jobs, req))
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
                        "logprobs": self._chat_logprobs(c.logprobs) if k is not None else None,
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

    def _completion_logprobs(self, logprobs: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
        tokens = [self.tokenizer.token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [
                {self.tokenizer.token_text(t): v for t, v in lp.top} for lp in logprobs
            ],
            "text_offset": offsets,
        }

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
                    "logprobs": self._completion_logprobs(lps) if k is not None and lps else None,
                    "finish_reason": reason,
                }

            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(request_id, jobs, req, include_usage, base, None, choice_chunk)
            return self._streaming_response(body, request_id, sum(len(p) for p in prompts))

        choices, usage = await run_until_disconnect(request, self._collect(request_id, jobs, req))
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
                        "logprobs": self._completion_logprobs(c.logprobs)
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
