"""`LLMEngine`: the synchronous core. `step()` = schedule → run the model → sample → update.

It keeps every request's sequences and detokenizers, applies the stop rules (EOS, stop token
ids, stop strings, max_tokens, context length) and reports what each request gained this step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modelyard.config import EngineSettings
from modelyard.engine.detokenizer import IncrementalDetokenizer
from modelyard.engine.kv_cache_manager import KVCacheManager, blocks_for
from modelyard.engine.memory import keep_freed_memory_for_reuse
from modelyard.engine.model_runner import ModelRunner
from modelyard.engine.models.config import ModelConfig
from modelyard.engine.models.loader import load_model, read_model_config, to_hf_folder
from modelyard.engine.models.sharding import check_tensor_parallel
from modelyard.engine.sampler import Sampler
from modelyard.engine.sampling_params import SamplingParams
from modelyard.engine.scheduler import Scheduler
from modelyard.engine.sequence import FinishReason, Sequence, TokenLogprob
from modelyard.engine.tensor_parallel import (
    HelperSpec,
    TensorParallelLeader,
    rank_device,
    threads_per_rank,
)
from modelyard.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request that can never run on this engine (too long, empty, bad token ids)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SequenceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None


@dataclass
class RequestOutput:
    request_id: str
    deltas: list[SequenceDelta]
    finished: bool
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class EngineStats:
    """Counters since start; gauges are read from the scheduler when asked."""

    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    steps: int = 0
    busy_seconds: float = 0.0
    requests_finished: dict[str, int] = field(default_factory=dict)


@dataclass
class _Request:
    request_id: str
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    emitted_tokens: list[int]  # per sequence: generated tokens already reported
    emitted_logprobs: list[int]
    reported_finish: list[bool]


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_native_bfloat16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 matmuls run about twice as fast as float32 on such CPUs."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" or cpu_has_native_bfloat16():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        settings: EngineSettings,
        max_model_len: int,
        num_blocks: int,
        model_name: str = "model",
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.settings = settings
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.model_config: ModelConfig = runner.config
        self.kv = KVCacheManager(num_blocks, settings.block_size, settings.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, settings.max_num_seqs, settings.max_num_batched_tokens)
        self.sampler = Sampler()
        self.stats = EngineStats()
        self._requests: dict[str, _Request] = {}
        self._next_seq_id = 0

    @classmethod
    def from_settings(cls, model: str | Path, settings: EngineSettings) -> LLMEngine:
        """Load the model and build the engine. With `tensor_parallel_size` N > 1 this process
        becomes rank 0 and starts N-1 helper rank processes (stopped by `close()`)."""
        tp = settings.tensor_parallel_size
        device = _resolve_device(settings.device)
        num_threads = settings.num_threads
        if tp > 1:
            device = rank_device(device, 0)
            if device.type == "cpu" and not num_threads:
                num_threads = threads_per_rank(tp)
        if num_threads:
            torch.set_num_threads(num_threads)
        dtype = _resolve_dtype(settings.dtype, device)
        if device.type == "cpu":
            keep_freed_memory_for_reuse()
        folder = to_hf_folder(model, settings.cache_dir)
        cfg = read_model_config(folder)
        check_tensor_parallel(cfg, tp)
        if tp > 1 and device.type == "cuda":
            available = torch.cuda.device_count()
            if (device.index or 0) + tp > available:
                raise ValueError(
                    f"tensor_parallel_size={tp} needs CUDA devices {device.index or 0}.."
                    f"{(device.index or 0) + tp - 1}, but this node has {available}"
                )
        limits = [cfg.max_position_embeddings]
        if settings.max_model_len:
            limits.append(settings.max_model_len)
        if cfg.sliding_window:
            limits.append(cfg.sliding_window)
        max_model_len = min(limits)
        # Each rank holds its 1/tp of the KV heads in its own kv_cache_memory.
        bytes_per_block = settings.block_size * cfg.kv_bytes_per_token(dtype.itemsize) // tp
        num_blocks = settings.kv_cache_memory // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={settings.kv_cache_memory} bytes holds no block of "
                f"{bytes_per_block} bytes; raise MODELYARD_KV_CACHE_MEMORY"
            )
        leader = None
        if tp > 1:
            spec = HelperSpec(
                folder=str(folder),
                dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                device=str(device),
                max_model_len=max_model_len,
                num_blocks=num_blocks,
                block_size=settings.block_size,
                num_threads=num_threads,
                world_size=tp,
                log_level=logging.getLogger().getEffectiveLevel(),
            )
            leader = TensorParallelLeader(spec, device)
        try:
            if leader is not None:
                leader.start()
            loaded = load_model(folder, dtype, device, max_model_len, tp_rank=0, tp_size=tp)
            runner = ModelRunner(
                loaded.model, cfg, num_blocks, settings.block_size, dtype, device, tp, leader
            )
            tokenizer = Tokenizer.load(folder, cfg)
            if leader is not None:
                leader.wait_ready()
        except BaseException:
            if leader is not None:
                leader.close()
            raise
        log.info(
            "engine ready: %s, %s on %s%s, %d KV blocks of %d tokens (%d tokens), max_model_len %d",
            model,
            dtype,
            device,
            f" x {tp} tensor-parallel ranks" if tp > 1 else "",
            num_blocks,
            settings.block_size,
            num_blocks * settings.block_size,
            max_model_len,
        )
        name = Path(str(model)).name if Path(str(model)).exists() else str(model)
        return cls(runner, tokenizer, settings, max_model_len, num_blocks, name)

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

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestRejected` for a request that can never be served here."""
        self.check_prompt(prompt_token_ids)
        self.check_lengths(len(prompt_token_ids), params)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise RequestRejected(f"token ids must be in [0, {vocab})", "prompt")

    def check_lengths(self, n: int, params: SamplingParams) -> None:
        if params.max_tokens > self.settings.max_tokens_cap:
            raise RequestRejected(
                f"max_tokens is {params.max_tokens}, above this server's cap of "
                f"{self.settings.max_tokens_cap}",
                "max_tokens",
            )
        if n + params.max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + params.max_tokens} tokens ({n} in the messages, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
                "messages",
            )
        if blocks_for(n + params.max_tokens, self.kv.block_size) > self.kv.num_blocks:
            raise RequestRejected(
                f"the request needs {n + params.max_tokens} tokens of KV cache but this replica "
                f"holds at most {self.token_capacity}; reduce the prompt or max_tokens",
                "max_tokens",
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival: float | None = None,
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        params.validate()
        self.check_request(prompt_token_ids, params)
        arrival = time.monotonic() if arrival is None else arrival
        seqs: list[Sequence] = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.runner.device)
                generator.manual_seed(params.seed + index)
            seq = Sequence(
                seq_id=self._next_seq_id,
                request_id=request_id,
                index=index,
                prompt_len=len(prompt_token_ids),
                token_ids=list(prompt_token_ids),
                params=params,
                priority=priority,
                arrival=arrival,
                leader=seqs[0] if seqs else None,
                generator=generator,
            )
            self._next_seq_id += 1
            seqs.append(seq)
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens
            )
            for _ in seqs
        ]
        n = len(seqs)
        self._requests[request_id] = _Request(
            request_id, seqs, detoks, [0] * n, [0] * n, [False] * n
        )
        for seq in seqs:
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

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ----- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        inputs = self.runner.prepare(plan.scheduled)
        logits = self.runner.execute(inputs)
        token_ids, logprobs = self.sampler(logits, inputs.sampling_seqs)

        for seq, n in plan.scheduled:
            if seq.prefilling:
                self.stats.prompt_tokens += min(n, seq.prompt_len - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            self.kv.commit(seq)

        touched: dict[str, _Request] = {}
        for seq, token, lp in zip(inputs.sampling_seqs, token_ids, logprobs, strict=True):
            req = self._requests[seq.request_id]
            touched[req.request_id] = req
            self._append_token(req, seq, token, lp)

        outputs = [self._collect(req) for req in touched.values()]
        self.stats.steps += 1
        self.stats.busy_seconds += time.perf_counter() - started
        return outputs

    def _append_token(
        self, req: _Request, seq: Sequence, token: int, lp: TokenLogprob | None
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
        if detok.stopped:
            self._finish(seq, FinishReason.STOP)
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)

    def _count_finished(self, reason: FinishReason) -> None:
        counts = self.stats.requests_finished
        counts[reason.value] = counts.get(reason.value, 0) + 1

    def _collect(self, req: _Request) -> RequestOutput:
        deltas: list[SequenceDelta] = []
        for i, seq in enumerate(req.seqs):
            if req.reported_finish[i]:
                continue
            new_tokens = seq.output_token_ids[req.emitted_tokens[i] :]
            if not new_tokens and not seq.finished:
                continue
            deltas.append(
                SequenceDelta(
                    index=seq.index,
                    text=req.detoks[i].take_delta(final=seq.finished),
                    token_ids=new_tokens,
                    logprobs=seq.logprobs[req.emitted_logprobs[i] :],
                    finish_reason=seq.finish_reason,
                )
            )
            req.emitted_tokens[i] += len(new_tokens)
            req.emitted_logprobs[i] = len(seq.logprobs)
            req.reported_finish[i] = seq.finished
        finished = all(s.finished for s in req.seqs)
        if finished:
            del self._requests[req.request_id]
            self._count_finished(req.seqs[0].finish_reason or FinishReason.STOP)
        leader = req.seqs[0]
        return RequestOutput(
            request_id=req.request_id,
            deltas=deltas,
            finished=finished,
            prompt_tokens=leader.prompt_len,
            cached_tokens=leader.num_cached_tokens,
            completion_tokens=sum(s.num_output_tokens for s in req.seqs),
        )
