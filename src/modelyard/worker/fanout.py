"""Run one API request's engine requests and gather their outputs: whole (JSON) or as SSE.

One API request may fan out into several engine requests (a list of prompts); their outputs
merge into one stream whose choice index is `prompt_index * n + sequence_index`. The API
shapes (chat or text completion chunks) come from the caller as chunk builders.

Streams carry usage as OpenAI does: only in one last chunk with empty `choices`, and only
when `stream_options.include_usage` asks for it (the gateway always asks, to bill). Asked by
the gateway (`TOKEN_STAMPS_HEADER`), each event also opens with its token stamp (`protocol.sse`):
a stream the client leaves is billed for what reached it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse

from modelyard.engine.client import (
    EngineClient,
    EngineDeadError,
    RequestFailed,
    RequestInvalid,
    RequestOutput,
    RequestTimeout,
    SamplingParams,
    TokenLogprob,
)
from modelyard.protocol.errors import GRAMMAR_FAILED, APIError, error_body
from modelyard.protocol.openai import PROMPT_TOKENS_HEADER, SamplingFields
from modelyard.protocol.sse import DONE, TOKEN_STAMPS_HEADER, sse_data, stamped
from modelyard.worker.metrics import RequestTimer, WorkerMetrics
from modelyard.worker.reasoning import ReasoningTokens

Job = tuple[list[int], SamplingParams]  # one engine request: its prompt and checked params
RoleChunk = Callable[[int], dict[str, Any]]
# A choice's chunk of the delta's text, logprobs and finish; None: nothing to send (yet).
ChoiceChunk = Callable[[int, str, list[TokenLogprob], str | None], dict[str, Any] | None]

# What a step can fail with; each becomes an API error (whole) or an error event (stream).
ENGINE_FAILURES = (RequestTimeout, EngineDeadError, RequestFailed)


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0


@dataclass
class Usage:
    prompt: dict[int, int] = field(default_factory=dict)  # per engine request
    cached: dict[int, int] = field(default_factory=dict)
    completion: dict[int, int] = field(default_factory=dict)
    reasoning: ReasoningTokens | None = None  # a reasoning model's: its thinking tokens

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        self.prompt[prompt_index] = out.prompt_tokens
        self.cached[prompt_index] = out.cached_tokens
        self.completion[prompt_index] = out.completion_tokens
        if self.reasoning is not None:
            for d in out.deltas:
                self.reasoning.add((prompt_index, d.index), d.token_ids)

    def totals(self) -> tuple[int, int]:
        """Prompt and completion tokens of all the engine requests."""
        return sum(self.prompt.values()), sum(self.completion.values())

    def as_dict(self) -> dict[str, Any]:
        prompt, completion = self.totals()
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,  # thinking included, as OpenAI counts it
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }
        if self.reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning.total}
        return usage


class FanOut:
    """The engine side of the OpenAI endpoints, shared by chat and text completions."""

    def __init__(self, engine: EngineClient, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics

    async def merged(
        self, request_id: str, jobs: list[Job], req: SamplingFields
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

    async def collect(
        self, request_id: str, jobs: list[Job], req: SamplingFields, usage: Usage | None = None
    ) -> tuple[dict[int, Choice], Usage]:
        """Every choice whole, by choice index, and the usage (`usage`, when given)."""
        timer = RequestTimer(self.metrics)
        choices: dict[int, Choice] = {}
        usage = usage if usage is not None else Usage()
        try:
            async for pi, out in self.merged(request_id, jobs, req):
                usage.add(pi, out)
                timer.output(out)
                for d in out.deltas:
                    c = choices.setdefault(pi * req.n + d.index, Choice())
                    c.text.append(d.text)
                    c.logprobs.extend(d.logprobs)
                    c.num_tokens += len(d.token_ids)
                    if d.finish_reason is not None:
                        c.finish_reason = d.finish_reason.value
        except ENGINE_FAILURES as exc:
            raise api_error(exc, sum(len(prompt) for prompt, _ in jobs)) from exc
        timer.done(*usage.totals())
        return choices, usage

    async def stream(
        self,
        request_id: str,
        jobs: list[Job],
        req: SamplingFields,
        include_usage: bool,
        base: dict[str, Any],
        role_chunk: RoleChunk | None,
        choice_chunk: ChoiceChunk,
        usage: Usage | None = None,
    ) -> AsyncIterator[bytes]:
        """The SSE events: `base` plus one choice chunk each, then usage if asked, then DONE.
        `usage` (kept up to date as the outputs come) is the caller's, to stamp the events."""
        timer = RequestTimer(self.metrics)
        usage = usage if usage is not None else Usage()
        try:
            if role_chunk is not None:
                for i in range(len(jobs) * req.n):
                    yield sse_data({**base, "choices": [role_chunk(i)]})
            async for pi, out in self.merged(request_id, jobs, req):
                usage.add(pi, out)
                timer.output(out)
                for d in out.deltas:
                    index = pi * req.n + d.index
                    chunk = (
                        choice_chunk(index, d.text, d.logprobs, None)
                        if d.text or d.logprobs
                        else None
                    )
                    if chunk is not None:
                        yield sse_data({**base, "choices": [chunk]})
                    if d.finish_reason is None:
                        continue
                    # The finish gets a chunk of its own with an empty delta, as OpenAI sends it;
                    # usage never rides on it (clients that add up usage chunks count once).
                    # (A reasoning model's text held back to the end may ride on it.)
                    last = choice_chunk(index, "", [], d.finish_reason)
                    if last is not None:
                        yield sse_data({**base, "choices": [last]})
            if include_usage:
                yield sse_data({**base, "choices": [], "usage": usage.as_dict()})
            timer.done(*usage.totals())
        except ENGINE_FAILURES as exc:
            yield sse_data(stream_error(exc))
        yield DONE


def wants_stamps(headers: Any) -> bool:
    """Whether the gateway asked for token stamps on this request's stream."""
    return bool(headers.get(TOKEN_STAMPS_HEADER) == "1")


async def stamp_tokens(body: AsyncGenerator[bytes, None], usage: Usage) -> AsyncIterator[bytes]:
    """Each event of `body` opened by its token stamp: the completion tokens generated when it
    was written (`body` updates `usage` before it yields what came of them)."""
    try:
        async for event in body:
            yield stamped(event, usage.totals()[1])
    finally:
        await body.aclose()  # at once: closing it is what aborts the generation


def streaming_response(
    body: AsyncIterator[bytes],
    request_id: str,
    prompt_tokens: int,
    stamps: Usage | None = None,
) -> StreamingResponse:
    """The stream's response; with `stamps` (the usage its body keeps) its events stamped."""
    if stamps is not None:
        assert isinstance(body, AsyncGenerator)
        body = stamp_tokens(body, stamps)
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


def api_error(exc: BaseException, prompt_tokens: int = 0) -> APIError:
    """The HTTP answer to a request that failed before its response started. A timeout spent
    engine time on the prompt (a prefill that never finished, or a generation cut): its answer
    reports the prompt's tokens (`PROMPT_TOKENS_HEADER`), which the gateway bills."""
    if isinstance(exc, RequestTimeout):
        worked = {PROMPT_TOKENS_HEADER: str(prompt_tokens)} if prompt_tokens else None
        return APIError(504, str(exc), code=exc.code, headers=worked)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, RequestInvalid):  # the client's grammar: not the replica's failure
        return APIError(400, str(exc), param="response_format", code=GRAMMAR_FAILED)
    return APIError(500, str(exc), code="engine_error")


def stream_error(exc: BaseException) -> dict[str, Any]:
    """The error event of a stream that failed after its status line was sent."""
    if isinstance(exc, RequestTimeout):
        return error_body(str(exc), "timeout_error", None, exc.code)
    if isinstance(exc, RequestInvalid):
        return error_body(str(exc), "invalid_request_error", "response_format", GRAMMAR_FAILED)
    return error_body(f"generation failed: {exc}", "server_error", None, "engine_error")
