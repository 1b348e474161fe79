"""OpenAI chat and text completions over the `EngineClient`: prompts in, JSON or SSE out.

This module turns the API request into engine requests, checked once, here, before anything
is queued (`modelyard.worker.checked_params`), and builds the API's response shapes; running the
engine requests and streaming their outputs is `modelyard.worker.fanout`'s job, tools (prompt,
constraint, parsing) `modelyard.worker.tools`'s, and a stream with tools
`modelyard.worker.tool_stream`'s, a reasoning model's thinking (split off the answer before
tools read it) `modelyard.worker.reasoning`'s. The Responses API (`modelyard.worker.responses`)
runs on `prepare_chat`/`chat_body` too.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from fastapi import Request

from modelyard.core.errors import model_not_found
from modelyard.engine.client import (
    ChatTemplateError,
    EngineClient,
    StructuredOutput,
    TokenLogprob,
)
from modelyard.protocol.disconnect import run_until_disconnect
from modelyard.protocol.errors import APIError, bad_request
from modelyard.protocol.openai import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from modelyard.protocol.responses import JSONResponse
from modelyard.worker import prefix_notes
from modelyard.worker.checked_params import admit, check_choices
from modelyard.worker.fanout import FanOut, Usage, streaming_response, wants_stamps
from modelyard.worker.logprobs import chat_logprobs, completion_logprobs
from modelyard.worker.metrics import WorkerMetrics
from modelyard.worker.prompt_bounds import PromptBudget
from modelyard.worker.reasoning import ReasoningSplitter, Thinking, reasoning_format
from modelyard.worker.structured import (
    compile_structured,
    structured_field,
    structured_for,
    structured_output_from_request,
)
from modelyard.worker.tool_parsers import parser_for
from modelyard.worker.tool_prompt import template_messages
from modelyard.worker.tool_stream import chat_tool_stream, choice_events
from modelyard.worker.tools import (
    ChatJob,
    ToolPlan,
    decode,
    message,
    plan_tools,
    tool_constraint,
)

T = TypeVar("T")
# Threads that render chat templates and tokenize prompts, off the event loop that also answers
# /health. The tokenizer releases the GIL while it runs (`Tokenizer.encode_many`); a template
# renders in Python, bounded by the prompt's character budget (`PromptBudget`).
PROMPT_THREADS = 4


def started_pool(threads: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads all run already. A pool starts a thread inside the `submit`
    that first needs it, and `Thread.start` waits for the thread to run: on a loaded CPU, with
    the engine's thread holding the GIL, that held a worker's event loop 270 ms on its first
    chat request. Each of `threads` tasks waits for all the others, so each submit starts one."""
    pool = ThreadPoolExecutor(threads, name)
    everyone = threading.Barrier(threads)
    for future in [pool.submit(everyone.wait) for _ in range(threads)]:
        future.result()
    return pool


class OpenAIServing:
    def __init__(self, engine: EngineClient, model_name: str, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.model_type = engine.model_type
        self.fanout = FanOut(engine, metrics)
        self.created = int(time.time())
        self.budget = PromptBudget(engine.max_model_len, self.tokenizer.max_chars_per_token())
        self.reasoning = reasoning_format(self.tokenizer)
        self._prompt_threads = started_pool(PROMPT_THREADS, "modelyard-prompt")

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a prompt thread (with this request's context: its logs' request id)."""
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prompt_threads, context.run, fn, *args)

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
                    "max_model_len": self.engine.max_model_len,
                }
            ],
        }

    def _check_model(self, req: SamplingFields, unsupported: str | None) -> str | None:
        """Refuse a foreign model or an unsupported field; returns the LoRA adapter that
        `<served model>:<adapter>` names (None: the base model)."""
        base, _, adapter = req.model.rpartition(":")
        lora = adapter if base == self.model_name and adapter else None
        if req.model != self.model_name and lora is None:
            raise APIError.from_domain(model_not_found(req.model))
        if unsupported:
            raise bad_request(
                f"'{unsupported}' is not supported by this server.", unsupported, "unsupported"
            )
        return lora

    # ----- chat ------------------------------------------------------------------------------

    async def prepare_chat(self, req: ChatCompletionRequest) -> ChatJob:
        """The checked engine request of a chat request: prompt (tools rendered), params (the
        tool choice's or response_format's constraint compiled), the tool plan."""
        lora = self._check_model(req, None)
        plan = plan_tools(req)
        renders_tools = self.tokenizer.template_supports_tools
        prompt, text = await self._off_loop(self._chat_prompt, req, plan, renders_tools)
        thinking = Thinking.of(self.reasoning, text)
        k = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if req.stream and k is not None and plan.active:
            raise bad_request("logprobs cannot be streamed with tools", "logprobs")
        structured = await self._chat_constraint(req, plan)
        if structured is not None and thinking is not None:  # the answer's, not the thinking's
            structured = dataclasses.replace(structured, gate=thinking.gate)
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = admit(self.engine, req, prompt, max_tokens, k, "messages", structured, lora)
        parser = parser_for(self.model_type, self.tokenizer.chat_template, renders_tools)
        return ChatJob(prompt, params, plan, parser, k, thinking)

    def _chat_prompt(
        self, req: ChatCompletionRequest, plan: ToolPlan, renders_tools: bool
    ) -> tuple[list[int], str]:
        """On a prompt thread: the messages and tools bounded against the context, then
        rendered by the chat template (its text returned too) and tokenized."""
        self.budget.check_chat(req)
        messages, tools = template_messages(req.messages, plan, renders_tools)
        variables = req.chat_template_kwargs
        try:
            text = self.tokenizer.render_chat(messages, tools=tools, variables=variables)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages", "invalid_messages") from exc
        # The rendered template already holds the special tokens (BOS included) it wants.
        prompt = self.tokenizer.encode_many([text], add_special_tokens=False)[0]
        self.budget.check_tokens(len(prompt), "messages")
        return prompt, text

    async def _chat_constraint(
        self, req: ChatCompletionRequest, plan: ToolPlan
    ) -> StructuredOutput | None:
        engine = self.engine
        if not plan.constrained:
            return await structured_for(engine, req)
        if structured_output_from_request(req) is not None:
            raise bad_request(
                f"'{structured_field(req)}' cannot be combined with a tool_choice that forces "
                "a call",
                structured_field(req),
            )
        return await compile_structured(engine, tool_constraint(plan), "tools")

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Any:
        job = await self.prepare_chat(req)
        prefix_notes.note(self.engine, request.headers, job.prompt, req.cache_salt, job.params)
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        created = int(time.time())
        base = {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model_name,
        }
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            usage = job.usage()
            if job.plan.active:
                events = choice_events(
                    self.fanout, request_id, [job.job], req, job.plan, job.parser, usage,
                    job.thinking,
                )  # fmt: skip
                body = chat_tool_stream(events, base, req.n, job.plan, include_usage)
            else:
                body = self._plain_chat_stream(request_id, job, req, base, include_usage, usage)
            stamps = usage if wants_stamps(request.headers) else None
            return streaming_response(body, request_id, len(job.prompt), stamps)
        result = await run_until_disconnect(request, self.chat_body(job, req, request_id))
        return JSONResponse({**result, "created": created}, headers={"x-request-id": request_id})

    async def chat_body(
        self, job: ChatJob, req: ChatCompletionRequest, request_id: str
    ) -> dict[str, Any]:
        """The non-streamed chat completion of a prepared request."""
        choices, usage = await self.fanout.collect(request_id, [job.job], req, job.usage())
        out = []
        for i, c in sorted(choices.items()):
            text = "".join(c.text)
            thinking, answer = job.thinking.split(text) if job.thinking else (None, text)
            decoded = decode(job.plan, job.parser, answer)
            reason = job.plan.finish_reason if decoded.calls else c.finish_reason
            msg = message(job.plan, decoded)
            if job.thinking is not None:
                msg["reasoning_content"] = thinking
            out.append(
                {
                    "index": i,
                    "message": msg,
                    "logprobs": chat_logprobs(self.tokenizer, c.logprobs)
                    if job.k is not None
                    else None,
                    "finish_reason": reason,
                }
            )
        return {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": out,
            "usage": usage.as_dict(),
        }

    def _plain_chat_stream(
        self,
        request_id: str,
        job: ChatJob,
        req: ChatCompletionRequest,
        base: dict[str, Any],
        include_usage: bool,
        usage: Usage,
    ) -> AsyncIterator[bytes]:
        k = job.k
        splitters: dict[int, ReasoningSplitter] = {}  # a reasoning model's, per choice

        def role_chunk(i: int) -> dict[str, Any]:
            return {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }

        def choice_chunk(
            i: int, text: str, lps: list[TokenLogprob], reason: str | None
        ) -> dict[str, Any] | None:
            delta = {"content": text} if text else {}
            if job.thinking is not None:
                splitter = splitters.setdefault(i, job.thinking.splitter())
                parts = splitter.finish() if reason else splitter.feed(text)
                names = ("reasoning_content", "content")
                delta = {name: v for name, v in zip(names, parts, strict=True) if v}
                if not (delta or lps or reason):
                    return None  # held back: it may be the start of a tag
            return {
                "index": i,
                "delta": delta,
                "logprobs": chat_logprobs(self.tokenizer, lps) if k is not None and lps else None,
                "finish_reason": reason,
            }

        return self.fanout.stream(
            request_id, [job.job], req, include_usage, base, role_chunk, choice_chunk, usage
        )

    # ----- completions -----------------------------------------------------------------------

    def _prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        """On a prompt thread: the prompts' token ids, each text bounded against the context
        before it is tokenized."""
        if isinstance(prompt, str):
            prompt = [prompt]
        prompts: list[list[int]]
        if prompt and all(isinstance(p, int) for p in prompt):
            prompts = [cast(list[int], list(prompt))]
        elif prompt and all(isinstance(p, str) for p in prompt):
            texts = cast(list[str], prompt)
            if len(texts) > MAX_PROMPTS:
                raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
            for text in texts:
                self.budget.check_text(text)
            prompts = self.tokenizer.encode_many(texts)
        elif prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in cast(list[list[int]], prompt)]
        else:
            raise bad_request("prompt must be a string, a list of strings or token ids", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
        for ids in prompts:
            self.budget.check_tokens(len(ids), "prompt")
        return prompts

    async def completion(self, req: CompletionRequest, request: Request) -> Any:
        lora = self._check_model(req, req.unsupported())
        prompts = await self._off_loop(self._prompts, req.prompt)
        check_choices(len(prompts), req.n)
        engine = self.engine
        structured = await structured_for(engine, req)
        jobs = [
            (p, admit(engine, req, p, req.max_tokens, req.logprobs, "prompt", structured, lora))
            for p in prompts
        ]
        if len(jobs) == 1:
            prefix_notes.note(engine, request.headers, jobs[0][0], req.cache_salt, jobs[0][1])
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
            usage = Usage()
            body = self.fanout.stream(
                request_id, jobs, req, include_usage, base, None, choice_chunk, usage
            )
            stamps = usage if wants_stamps(request.headers) else None
            return streaming_response(body, request_id, sum(len(p) for p in prompts), stamps)

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
