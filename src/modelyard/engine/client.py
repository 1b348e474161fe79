"""The engine's front door: `EngineClient`, what a process serving the engine (the worker) may ask
of it, and the plain data types that cross that door.

The worker imports this module and nothing else of `modelyard.engine` (`tests/test_layers.py`
holds it to that). As vLLM's `EngineClient`, it is a handful of names:

- its life: `start`, `shutdown`, `on_failure`, `healthy`, `error`;
- the model it serves: `model_name`, `model_type`, `max_model_len`, `tokenizer`, `numerics`
  (quantization, dtypes, and why they were chosen);
- a request checked at the edge, before anything is queued: `default_max_tokens`,
  `check_request` (`RequestRejected` naming the field), `compile_grammar` (`ValueError`);
- requests: `generate`, one async stream of `RequestOutput`s each; leaving the stream early
  aborts the request (its blocks are freed at the next step);
- its load: `snapshot` (`EngineSnapshot`, the gauges and counters of /health and /metrics);
- its prefix cache, for cache-aware routing: `note_prefix` (a request's gateway prefix keys),
  `prefix_digest` (those its cache holds: `engine/prefix_digest.py`).

`LocalEngineClient` is the one implementation: an `AsyncEngine` (the engine loop in a thread of
this process), built from settings by `LocalEngineClient.load`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from modelyard.config import EngineSettings
from modelyard.engine.async_engine import AsyncEngine, EngineDeadError, RequestTimeout
from modelyard.engine.cores import usable_cores
from modelyard.engine.defaults import Choice, Numerics
from modelyard.engine.faults import RequestFailed, RequestInvalid
from modelyard.engine.grammar_threads import grammar_executor
from modelyard.engine.kv_cache_manager import salt_bytes
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.loading import choice_for, resolve_device
from modelyard.engine.lora.engine_hooks import AdapterReads, check_adapter
from modelyard.engine.models.bundled import resolve_model_path
from modelyard.engine.prefix_digest import PrefixDigest
from modelyard.engine.request_checks import RequestRejected
from modelyard.engine.requests import RequestOutput, SequenceDelta
from modelyard.engine.sampling_params import MAX_N, SamplingParams
from modelyard.engine.sequence import TokenLogprob
from modelyard.engine.structured import StructuredKind, StructuredOutput, ThinkingGate
from modelyard.engine.tokenizer import ChatTemplateError, Tokenizer

__all__ = [
    "MAX_N",
    "ChatTemplateError",
    "EngineClient",
    "EngineDeadError",
    "EngineSnapshot",
    "LocalEngineClient",
    "Numerics",
    "RequestFailed",
    "RequestInvalid",
    "RequestOutput",
    "RequestRejected",
    "RequestTimeout",
    "SamplingParams",
    "SequenceDelta",
    "StructuredKind",
    "StructuredOutput",
    "ThinkingGate",
    "TokenLogprob",
    "Tokenizer",
    "resolve_model_path",
    "served_settings",
]


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges and its counters since start, read at one moment."""

    running: int  # sequences in the running batch
    waiting: int  # sequences waiting to run (and requests waiting for an adapter slot)
    kv_cache_usage: float  # fraction of KV blocks in use
    kv_cache_capacity_tokens: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int
    prompt_tokens: int  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int
    steps: int
    failed_steps: int  # steps that raised (their requests were retried one by one)
    interrupted_steps: int  # steps of batch alone stopped for a real-time arrival (rerun)
    busy_seconds: float
    preemptions: int
    requests_finished: dict[str, int]  # by finish reason
    lora_loaded: tuple[str, ...] = ()  # adapters in LoRA slots, least recently used first
    # (priority, "swap" | "recompute") -> sequences preempted; they sum to `preemptions`
    preemptions_by: dict[tuple[int, str], int] = field(default_factory=dict)
    kv_swap_capacity_blocks: int = 0  # the swap pool's size (0: no pool)
    kv_swap_used_blocks: int = 0  # blocks of swapped-out sequences in it now
    kv_swapped_out_blocks: int = 0  # counters: blocks copied into the pool, and back
    kv_swapped_in_blocks: int = 0
    # speculative decoding counters: drafts verified (sequence-steps), their tokens, accepted
    # ones, and the tokens those sequence-steps emitted (accepted + the target's own one each)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    max_num_seqs: int = 0  # sequence slots of the running batch (0: not reported)


class EngineClient(Protocol):
    """What the worker may ask of the engine (see the module docstring)."""

    # ----- its life ------------------------------------------------------------------------

    def start(self) -> None:
        """Start serving requests."""
        ...

    def shutdown(self) -> None:
        """Stop serving, and stop what outlives the object (tensor-parallel helper ranks).
        Idempotent; also safe when `start` never ran."""
        ...

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(why)`, once, from another thread, when the engine can no longer serve."""
        ...

    @property
    def healthy(self) -> bool: ...

    @property
    def error(self) -> str | None:
        """Why the engine stopped serving for good (None while it serves)."""
        ...

    # ----- the model -----------------------------------------------------------------------

    @property
    def model_name(self) -> str: ...

    @property
    def model_type(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def numerics(self) -> Numerics | None:
        """The quantization and dtypes it loaded with, and why (None: not loaded from settings)."""
        ...

    # ----- a request at the edge -----------------------------------------------------------

    def default_max_tokens(self, prompt_len: int) -> int: ...

    def check_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        prompt_param: str = "prompt",
    ) -> None:
        """`RequestRejected` (naming the field) for a request that can never run here, its
        LoRA adapter (`params.lora`) included; `generate` trusts a request that passed."""
        ...

    async def compile_grammar(self, structured: StructuredOutput) -> StructuredOutput:
        """`structured` with this request's own fresh matcher attached (its grammar compiled, or
        from the cache, on the grammar threads: never on the event loop or the engine's thread);
        `ValueError` naming the problem when it does not compile or breaks on its first mask."""
        ...

    # ----- requests ------------------------------------------------------------------------

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come. Fails with `RequestFailed` (`RequestInvalid`:
        its own grammar), `RequestTimeout` or `EngineDeadError`. `cache_salt` is its
        prefix-cache namespace."""
        ...

    # ----- its load ------------------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot: ...

    # ----- its prefix cache ----------------------------------------------------------------

    def note_prefix(
        self,
        prompt_token_ids: list[int],
        cache_salt: str | None,
        keys: Sequence[bytes],
        ends: Sequence[int],
    ) -> None:
        """The gateway's prefix keys of a request (key i spans its first `ends[i]` tokens)."""
        ...

    def prefix_digest(self, limit: int) -> tuple[int, list[bytes]]:
        """(generation, up to `limit` noted keys whose KV blocks the prefix cache holds)."""
        ...


def _lora_loaded(lora: Any) -> tuple[str, ...]:
    """The adapters in slots, read from another thread than the engine's (a step that loads
    one while this reads gives an empty answer this once)."""
    if lora is None:
        return ()
    try:
        return tuple(lora.loaded)
    except RuntimeError:  # the slots changed during the read
        return ()


def served_settings(settings: EngineSettings, choice: Choice | None = None) -> EngineSettings:
    """A served engine on CPU leaves one core to its process's HTTP server and event loop:
    torch's OpenMP threads spin while they wait, and with one per core they starved the loop
    that streams tokens (SmolLM2 w8a8 on 2 vCPU, `benchmarks/serving.py`: 62.9 output tok/s
    at concurrency 1 with one thread against 33.9 with two). `num_threads` set wins. Not under
    `gguf+w8a8` (`choice`, what the load will choose): there a decode step of up to four
    sequences is one C call with no torch op in its layers, so torch's threads run only
    prefills and wider steps, where every core counts (SmolLM2 Q4_1, 2 vCPU AVX2: concurrency
    1 91 vs 93 tok/s, 32 293 vs 200-220 tok/s with both cores; BENCHMARKS.md)."""
    on_cpu = resolve_device(settings.device).type == "cpu"
    cores = usable_cores()
    one_call = choice is not None and choice.quantization == "gguf+w8a8"
    if (
        settings.num_threads is None
        and settings.tensor_parallel_size == 1
        and on_cpu
        and cores > 1
        and not one_call
    ):
        return settings.model_copy(update={"num_threads": cores - 1})
    return settings


class LocalEngineClient:
    """`EngineClient` over an `AsyncEngine` in this process."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._core = engine.engine
        kv = self._core.kv
        self._digest = PrefixDigest(kv, max(4096, kv.num_blocks))
        self._adapter_reads = AdapterReads()

    @classmethod
    def load(cls, model: str | Path, settings: EngineSettings) -> LocalEngineClient:
        """Load the model (`served_settings`) and build the engine; with
        `tensor_parallel_size` N > 1 this process becomes rank 0 and starts N-1 helper ranks."""
        settings = served_settings(settings, choice_for(model, settings))
        core = LLMEngine.from_settings(model, settings)
        return cls(AsyncEngine(core, settings.request_timeout_s, settings.no_progress_timeout_s))

    # ----- its life ------------------------------------------------------------------------

    def start(self) -> None:
        self._engine.start()

    def shutdown(self) -> None:
        self._adapter_reads.close()
        self._engine.shutdown()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        leader = self._core.runner.leader
        if leader is not None:
            leader.on_failure = lambda why: callback(f"tensor-parallel group failed ({why})")
        self._engine.on_fatal = lambda why: callback(f"engine failed ({why})")

    @property
    def healthy(self) -> bool:
        return self._engine.healthy

    @property
    def error(self) -> str | None:
        if self._engine.error is not None:
            return str(self._engine.error)
        return self._core.failure

    # ----- the model -----------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._core.model_name

    @property
    def model_type(self) -> str:
        return self._core.model_config.model_type

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self._core.tokenizer

    @property
    def numerics(self) -> Numerics | None:
        return self._core.numerics

    # ----- a request at the edge -----------------------------------------------------------

    def default_max_tokens(self, prompt_len: int) -> int:
        return self._core.default_max_tokens(prompt_len)

    def check_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        prompt_param: str = "prompt",
    ) -> None:
        self._core.check_request(prompt_token_ids, params, priority, prompt_param)
        if params.lora is not None:
            check_adapter(self._core.runner, params.lora)

    async def compile_grammar(self, structured: StructuredOutput) -> StructuredOutput:
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(
            grammar_executor(), context.run, self._core.grammars.prepare, structured
        )
        return StructuredOutput(structured.kind, structured.spec, prepared)

    # ----- requests ------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if params.lora is not None:  # off the engine's loop, which then only copies it
            await self._adapter_reads.read(self._core.runner.lora, params.lora)
        stream = self._engine.generate(prompt_token_ids, params, request_id, priority, cache_salt)
        async with contextlib.aclosing(stream):  # leaving early aborts the request at once
            async for out in stream:
                yield out

    # ----- its load ------------------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        e = self._core
        s = e.stats
        pool = e.preemptor.pool
        return EngineSnapshot(
            running=e.num_running,
            waiting=e.num_waiting,
            kv_cache_usage=e.kv.usage(),
            kv_cache_capacity_tokens=e.token_capacity,
            prefix_cache_queries=e.kv.prefix_queries,
            prefix_cache_hits=e.kv.prefix_hits,
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            steps=s.steps,
            failed_steps=s.failed_steps,
            interrupted_steps=e.interrupt.count,
            busy_seconds=s.busy_seconds,
            preemptions=e.scheduler.num_preemptions,
            requests_finished=dict(s.requests_finished),
            lora_loaded=_lora_loaded(e.runner.lora),
            preemptions_by={(p, str(m)): n for (p, m), n in dict(e.preemptor.counts).items()},
            kv_swap_capacity_blocks=pool.num_blocks if pool else 0,
            kv_swap_used_blocks=pool.num_used if pool else 0,
            kv_swapped_out_blocks=pool.swapped_out_blocks if pool else 0,
            kv_swapped_in_blocks=pool.swapped_in_blocks if pool else 0,
            spec_drafts=e.spec_stats.spec_steps,
            spec_draft_tokens=e.spec_stats.draft_tokens,
            spec_accepted_tokens=e.spec_stats.accepted_tokens,
            spec_emitted_tokens=e.spec_stats.emitted_tokens,
            max_num_seqs=e.scheduler.max_num_seqs,
        )

    # ----- its prefix cache ----------------------------------------------------------------

    def note_prefix(
        self,
        prompt_token_ids: list[int],
        cache_salt: str | None,
        keys: Sequence[bytes],
        ends: Sequence[int],
    ) -> None:
        self._digest.note(prompt_token_ids, salt_bytes(cache_salt), keys, ends)

    def prefix_digest(self, limit: int) -> tuple[int, list[bytes]]:
        return self._digest.notes, self._digest.held(limit)
