"""`LLMEngine`: the synchronous core. `step()` = schedule → run the model → sample → update.

It keeps every request's sequences and detokenizers, applies the stop rules (EOS, stop token
ids, stop strings, max_tokens, context length) and reports what each request gained this step.
Requests are checked once before they get here (`modelyard.engine.request_checks`); a step that
raises anyway fails only the requests that cause it and the engine goes on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from modelyard.config import BATCH_PRIORITY, EngineSettings
from modelyard.engine.defaults import Numerics
from modelyard.engine.draft_model import DraftModelDrafter, load_draft
from modelyard.engine.engine_stats import EngineStats
from modelyard.engine.faults import RequestFailed, RequestInvalid, is_fatal
from modelyard.engine.grammar import GrammarCompiler, GrammarViolation
from modelyard.engine.kv_cache_manager import KVCacheManager, salt_bytes
from modelyard.engine.loading import LoadedEngine, load
from modelyard.engine.lora.engine_hooks import AdapterWaitlist, adapter_namespace
from modelyard.engine.model_runner import ModelRunner
from modelyard.engine.models.config import ModelConfig
from modelyard.engine.preemption import make_preemptor
from modelyard.engine.request_checks import EngineLimits, RequestRejected, check_request
from modelyard.engine.requests import EngineRequest, RequestOutput
from modelyard.engine.sampler import Sampler
from modelyard.engine.sampling_params import SamplingParams
from modelyard.engine.scheduler import Scheduler
from modelyard.engine.sequence import FinishReason, Sequence, TokenLogprob
from modelyard.engine.spec_decode import NgramDrafter, Sampled, SpecStats, sample_step
from modelyard.engine.step_cost import StepCost
from modelyard.engine.step_interrupt import StepInterrupt, StepInterrupted
from modelyard.engine.tokenizer import Tokenizer

__all__ = ["LLMEngine", "RequestFailed", "RequestOutput", "RequestRejected"]

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        settings: EngineSettings,
        max_model_len: int,
        num_blocks: int,
        model_name: str = "model",
        numerics: Numerics | None = None,
        draft: LoadedEngine | None = None,
    ) -> None:
        """`draft`: the draft model's parts when `settings.speculative` is `draft`."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.settings = settings
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.numerics = numerics  # how `from_settings` loaded it (None: built from parts)
        self.model_config: ModelConfig = runner.config
        self.kv = KVCacheManager(num_blocks, settings.block_size, settings.enable_prefix_caching)
        self.preemptor = make_preemptor(
            self.kv,
            runner.kv_caches,
            settings.preemption_mode,
            settings.kv_swap_memory,
            tensor_parallel=runner.leader is not None,
        )
        backfill = StepCost(settings.backfill_step_slowdown, 2 * settings.max_num_seqs)
        self.scheduler = Scheduler(
            self.kv, settings.max_num_seqs, settings.max_num_batched_tokens, self.preemptor,
            backfill, BATCH_PRIORITY,
        )  # fmt: skip
        # Steps of batch alone stop between layers for a real-time arrival (one CPU process).
        on_cpu = runner.leader is None and runner.device.type == "cpu"
        self.interrupt = runner.model.interrupt = StepInterrupt(on_cpu)
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(tokenizer, self.model_config.vocab_size)
        self.stats = EngineStats()
        self.spec_stats = SpecStats()
        if settings.speculative == "ngram":
            self.scheduler.drafter = NgramDrafter(
                settings.num_speculative_tokens,
                settings.prompt_lookup_min,
                settings.prompt_lookup_max,
                max_model_len,
            )
        elif settings.speculative == "draft":
            if draft is None:
                raise ValueError("speculative=draft needs the draft model (speculative_model)")
            self.scheduler.drafter = DraftModelDrafter(
                draft.runner,
                draft.num_blocks,
                settings.num_speculative_tokens,
                min(max_model_len, draft.max_model_len),
            )
        self._requests: dict[str, EngineRequest] = {}
        self._next_seq_id = 0
        self.lora_waiting = AdapterWaitlist()  # requests whose adapter waits for a slot

    @classmethod
    def from_settings(cls, model: str | Path, settings: EngineSettings) -> LLMEngine:
        """Load the model and build the engine. With `tensor_parallel_size` N > 1 this process
        becomes rank 0 and starts N-1 helper rank processes (stopped by `close()`)."""
        parts = load(model, settings)
        try:
            draft = load_draft(settings, parts) if settings.speculative == "draft" else None
        except BaseException:
            parts.runner.close()
            raise
        return cls(
            parts.runner,
            parts.tokenizer,
            settings,
            parts.max_model_len,
            parts.num_blocks,
            parts.model_name,
            parts.numerics,
            draft,
        )

    def close(self) -> None:
        """Release what outlives the object: the tensor-parallel helper ranks (idempotent)."""
        self.runner.close()

    @property
    def failure(self) -> str | None:
        """Why the tensor-parallel group died (a helper rank exited or a collective failed)."""
        leader = self.runner.leader
        return None if leader is None else leader.failure

    # ----- admission -------------------------------------------------------------------------

    @property
    def token_capacity(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(1, min(self.settings.max_tokens_cap, self.max_model_len - prompt_len))

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            max_tokens_cap=self.settings.max_tokens_cap,
            block_size=self.kv.block_size,
            num_blocks=self.kv.num_blocks,
        )

    def check_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        prompt_param: str = "prompt",
    ) -> None:
        """Raise `RequestRejected` for a request that can never be served here; a request
        must pass this before `add_request`, which trusts it."""
        check_request(self.limits, prompt_token_ids, params, priority, prompt_param)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival: float | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> None:
        """Queue a checked request. Its prompt shares prefix-cache blocks only with requests of
        the same `cache_salt` (none: with the other requests without one) and the same `lora`
        adapter (`RequestRejected` naming `model` if it cannot be served; while every adapter
        slot is held by running requests, the request waits for one in `lora_waiting`)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        arrival = time.monotonic() if arrival is None else arrival
        salt = salt_bytes(cache_salt)
        lora = lora if lora is not None else params.lora
        if lora is not None:
            salt += b"\0lora\0" + adapter_namespace(self.runner, lora)
        req = EngineRequest.create(
            request_id,
            prompt_token_ids,
            params,
            self.tokenizer,
            self.runner.device,
            self._next_seq_id,
            priority,
            arrival,
            salt,
        )
        if params.structured is not None:
            for seq in req.seqs:
                seq.grammar = self.grammars.matcher(params.structured, seq.params.max_tokens)
        self._next_seq_id += len(req.seqs)
        self._requests[request_id] = req
        if lora is None or self.lora_waiting.hold(self.runner, req, lora, self._requests):
            for seq in req.seqs:
                self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = FinishReason.ABORT
                self.scheduler.remove(seq)
        self._count_finished(FinishReason.ABORT)
        return True

    def urgent(self, priority: int) -> None:
        """A request of `priority` is queued (any thread): a step of batch alone stops for it."""
        if priority < BATCH_PRIORITY:
            self.interrupt.request()

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.lora_waiting)

    # ----- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step. A step that raises is retried request by request: the requests that fail
        alone are failed (an output with `error`, their blocks freed) and the others go on.
        Fatal errors (`faults.is_fatal`) and failures outside the model and sampler propagate."""
        started = time.perf_counter()
        if self.lora_waiting:  # holders that finished freed their adapter slots
            for req in self.lora_waiting.admit(self.runner, self._requests):
                for seq in req.seqs:
                    self.scheduler.add(seq)
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        try:
            with self.interrupt.arming(plan.backfill_only):
                sampled = self._forward(plan.scheduled)
            failed: dict[str, BaseException] = {}
        except StepInterrupted:  # nothing sampled or committed: the same step runs later
            for seq, _ in plan.scheduled:
                seq.drop_draft()
            self.stats.busy_seconds += time.perf_counter() - started
            return []
        except Exception as exc:
            if self._fatal(exc):
                raise
            log.warning("engine step failed (%r); retrying its requests one by one", exc)
            self.stats.failed_steps += 1
            sampled, failed = self._isolate(plan.scheduled)

        outputs = [self._fail(self._requests[rid], exc) for rid, exc in failed.items()]
        for seq, n in plan.scheduled:
            if seq.request_id in failed:
                seq.drop_draft()
                continue
            if seq.prefilling:
                self.stats.prompt_tokens += min(n, seq.prompt_len - seq.num_computed_tokens)
            if not seq.draft:  # a draft's rows advance by what is accepted, once it is known
                seq.num_computed_tokens += n
                self.kv.commit(seq)

        by_request: dict[str, list[Sampled]] = {}
        for item in sampled:
            by_request.setdefault(item[0].request_id, []).append(item)
        for request_id, items in by_request.items():
            req = self._requests[request_id]
            try:
                for seq, tokens, lp in items:
                    self._append_tokens(req, seq, tokens, lp)
                outputs.append(self._collect(req))
            except Exception as exc:  # e.g. the detokenizer: this request's fault alone
                if self._fatal(exc):
                    raise
                log.warning("request %s failed after sampling: %r", request_id, exc)
                outputs.append(self._fail(req, exc))
        self.stats.steps += 1
        self.stats.busy_seconds += time.perf_counter() - started
        return outputs

    def _forward(self, scheduled: list[tuple[Sequence, int]]) -> list[Sampled]:
        """Run the model and the sampler (verifying drafts); only the KV cache slots of this
        step are written, so running the same sequences again writes the same values.
        Prefill-heavy steps are timed for the preemption cost model (a draft's rows count as
        decodes)."""
        started = time.perf_counter()
        inputs = self.runner.prepare(scheduled)
        logits = self.runner.execute(inputs)
        sampled = sample_step(self.sampler, logits, inputs.sampling_seqs)  # waits for the step
        num_tokens = sum(n for _, n in scheduled)
        prefill = sum(n for s, n in scheduled if n > 1 and not s.draft)  # a draft: decodes
        self.preemptor.costs.observe_step(num_tokens, prefill, time.perf_counter() - started)
        self.scheduler.step_cost.observe(num_tokens, time.perf_counter() - started)
        return sampled

    def _fatal(self, exc: BaseException) -> bool:
        """No retry after this: the process is in doubt, or the tensor-parallel group died."""
        return is_fatal(exc) or self.failure is not None

    def _isolate(
        self, scheduled: list[tuple[Sequence, int]]
    ) -> tuple[list[Sampled], dict[str, BaseException]]:
        """Run each request of a failed step alone: what succeeds is kept, what fails again
        is the request's own fault."""
        groups: dict[str, list[tuple[Sequence, int]]] = {}
        for seq, n in scheduled:
            groups.setdefault(seq.request_id, []).append((seq, n))
        sampled: list[Sampled] = []
        failed: dict[str, BaseException] = {}
        for request_id, group in groups.items():
            try:
                sampled += self._forward(group)
            except Exception as exc:
                if self._fatal(exc):
                    raise
                log.warning("request %s failed in an engine step: %r", request_id, exc)
                failed[request_id] = exc
        return sampled, failed

    def _fail(self, req: EngineRequest, exc: BaseException) -> RequestOutput:
        """Take a request out of the engine after its step failed; its blocks are freed."""
        self._requests.pop(req.request_id, None)
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = FinishReason.ERROR
                self.scheduler.remove(seq)
        self._count_finished(FinishReason.ERROR)
        if isinstance(exc, GrammarViolation):  # the request's own grammar: a 400, not a fault
            error: RequestFailed = RequestInvalid(f"the structured output's grammar failed: {exc}")
        else:
            error = RequestFailed(f"generation failed in the engine: {exc!r}")
        return req.output([], True, error)

    def fail_all(self, exc: BaseException) -> list[RequestOutput]:
        """Fail every request (a step failed where no request can be blamed)."""
        return [self._fail(req, exc) for req in list(self._requests.values())]

    def _append_tokens(
        self, req: EngineRequest, seq: Sequence, tokens: list[int], lp: TokenLogprob | None
    ) -> None:
        """Append a step's tokens until one finishes the sequence. After a draft, the KV of
        its accepted positions counts as computed and the rest is rolled back."""
        for token in tokens:
            self._append_token(req, seq, token, lp)
            if seq.finished:
                break
        if seq.draft:
            self.spec_stats.record(len(seq.draft), len(tokens))
            if not seq.finished:
                seq.num_computed_tokens += len(tokens)  # the last real token and the accepted
                self.kv.trim(seq)
                self.kv.commit(seq)
            seq.draft = []

    def _append_token(
        self, req: EngineRequest, seq: Sequence, token: int, lp: TokenLogprob | None
    ) -> None:
        seq.token_ids.append(token)
        self.stats.generation_tokens += 1
        if lp is not None:
            seq.logprobs.append(lp)
        p = seq.params
        detok = req.detoks[seq.index]
        eos = token in self.tokenizer.eos_token_ids or token in p.extra_eos_token_ids
        if (eos and not p.ignore_eos) or token in p.stop_token_ids:
            self._finish(seq, FinishReason.STOP)
            return
        detok.add_token(token)
        # A complete grammar ends the sequence (the matcher raises on a refused token).
        if detok.stopped or (seq.grammar is not None and seq.grammar.advance(token)):
            self._finish(seq, FinishReason.STOP)
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)

    def _count_finished(self, reason: FinishReason) -> None:
        counts = self.stats.requests_finished
        counts[reason.value] = counts.get(reason.value, 0) + 1

    def _collect(self, req: EngineRequest) -> RequestOutput:
        deltas = req.take_deltas()
        finished = req.finished
        if finished:
            del self._requests[req.request_id]
            self._count_finished(req.seqs[0].finish_reason or FinishReason.STOP)
        return req.output(deltas, finished)
