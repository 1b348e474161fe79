"""Speculative decoding with a draft model: a smaller model of the same tokenizer, loaded in the
same process with its own model runner and KV cache, proposes the next k tokens of a decoding
sequence; the target verifies them in one batched step (`spec_decode.verify`).

The draft keeps a shadow of every sequence it drafted for: its own token list, blocks and
computed count. Before each proposal the shadow is brought level with the sequence: the target
never changes a token once emitted, so the draft's KV stays valid up to the first position where
its own last proposal and the accepted tokens part; from there it computes what it lacks (the
accepted tokens and the target's bonus token, or the whole prompt the first time) in one chunk,
then decodes k-1 more tokens one at a time. A greedy sequence gets the draft's argmax tokens
(output identical to plain decoding whatever the draft proposes); a sampling one gets tokens
drawn from the draft's distribution q under the same temperature, top-k/p, min-p and logit bias
as the target, and q's rows go with the draft so that `verify` accepts each with min(1, p/q).
A shadow is freed when its sequence leaves the scheduler, and whenever the draft's cache is full
(that sequence then decodes without a draft until there is room again).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modelyard.config import EngineSettings
from modelyard.engine.kv_cache_manager import KVCacheManager
from modelyard.engine.loading import LoadedEngine, load
from modelyard.engine.model_runner import ModelRunner
from modelyard.engine.models.loader import read_model_config, to_hf_folder
from modelyard.engine.sampler import _apply_logit_bias, _draw, _filter
from modelyard.engine.sequence import Sequence
from modelyard.engine.spec_decode import draft_length, speculable

# Text both tokenizers must split into the same ids (a draft of another tokenizer is refused).
_PROBE = (
    "The quick brown fox jumps over the lazy dog. 1234 + 5678 = 6912; ¿Qué tal? 東京\n\tdef f(x):"
)


class DraftMismatch(ValueError):
    """The draft model cannot draft for this model (another vocabulary or tokenizer)."""


def load_draft(settings: EngineSettings, target: LoadedEngine) -> LoadedEngine:
    """The draft model of `speculative=draft`, loaded like the model (device, dtype, kernels,
    quantization) on one rank, without LoRA, with a KV cache of as many tokens as the model's;
    `DraftMismatch` unless it has the model's vocabulary and tokenizer."""
    if not settings.speculative_model:
        raise DraftMismatch("speculative=draft needs speculative_model")
    folder = to_hf_folder(settings.speculative_model, settings.cache_dir)
    cfg = read_model_config(folder)
    want = target.runner.config.vocab_size
    if cfg.vocab_size != want:
        raise DraftMismatch(
            f"speculative_model has vocab_size {cfg.vocab_size}, the model {want}: a draft model "
            "must share the model's tokenizer"
        )
    tokens = target.num_blocks * settings.block_size
    own = settings.model_copy(
        update={
            "speculative": "off",
            "speculative_model": None,
            "tensor_parallel_size": 1,
            "max_loras": 0,
            "kv_cache_memory": tokens * cfg.kv_bytes_per_token(4),  # float32: room to spare
            "preemption_mode": "recompute",
            "kv_swap_memory": 0,
        }
    )
    draft = load(folder, own)
    if target.tokenizer.encode(_PROBE) != draft.tokenizer.encode(_PROBE):
        draft.runner.close()
        raise DraftMismatch(
            "speculative_model tokenizes text differently from the model: a draft model must "
            "share the model's tokenizer"
        )
    return draft


@dataclass
class _Shadow:
    seq: Sequence  # the draft's own view: token ids, blocks, computed count
    level: int  # tokens of the target sequence known equal to the shadow's (never re-checked)


@dataclass
class DraftModelDrafter:
    """Proposes drafts from a draft model (the scheduler's drafter with `speculative=draft`)."""

    runner: ModelRunner
    num_blocks: int
    num_speculative_tokens: int
    max_model_len: int  # the smaller of the target's and the draft's
    _shadows: dict[int, _Shadow] = field(default_factory=dict)
    kv: KVCacheManager = field(init=False)
    forward_passes: int = 0  # draft model steps run (each one sequence)

    def __post_init__(self) -> None:
        self.kv = KVCacheManager(self.num_blocks, self.runner.block_size, enable_caching=False)

    def __call__(self, seq: Sequence, budget: int) -> list[int]:
        seq.draft_probs = None
        if not speculable(seq):
            return []
        k = draft_length(seq, self.num_speculative_tokens, budget, self.max_model_len)
        if k <= 0:
            return []
        shadow = self._level(seq)
        draft: list[int] = []
        rows: list[torch.Tensor] = []
        n = shadow.num_tokens - shadow.num_computed_tokens
        if n == 0:  # it drafted these very tokens last time: compute the last one again
            shadow.num_computed_tokens -= 1
            n = 1
        for _ in range(k):
            if not self.kv.allocate(shadow, n):
                self.release(seq)  # the cache is full: this sequence decodes plainly for now
                break
            logits = self.runner.execute(self.runner.prepare([(shadow, n)]))
            self.forward_passes += 1
            shadow.num_computed_tokens += n
            token, q = self._pick(logits, seq)
            shadow.token_ids.append(token)
            draft.append(token)
            if q is not None:
                rows.append(q)
            n = 1
        if draft and rows:
            seq.draft_probs = torch.stack(rows)
        return draft

    def _level(self, seq: Sequence) -> Sequence:
        """The sequence's shadow, with its computed count cut back to what still matches."""
        entry = self._shadows.get(seq.seq_id)
        if entry is None:
            shadow = Sequence(seq.seq_id, seq.request_id, seq.index, seq.prompt_len, [], seq.params)
            entry = self._shadows[seq.seq_id] = _Shadow(shadow, 0)
        shadow, tokens = entry.seq, seq.token_ids
        valid = min(shadow.num_computed_tokens, len(tokens))
        for i in range(entry.level, valid):  # only the last proposal may differ
            if shadow.token_ids[i] != tokens[i]:
                valid = i
                break
        shadow.num_computed_tokens = valid
        shadow.token_ids = list(tokens)
        entry.level = len(tokens)
        self.kv.trim(shadow)
        return shadow

    def _pick(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor | None]:
        """The draft's token after `logits` (`[1, vocab]`) and, when sampling, its q row."""
        if seq.params.logit_bias:
            logits = logits.clone()
            _apply_logit_bias(logits, [seq], [0])
        if seq.params.greedy:
            return int(logits.max(dim=1).indices[0]), None
        filtered = _filter(logits, [seq])
        token = int(_draw(filtered, [seq])[0])
        return token, filtered[0].softmax(dim=0)

    def release(self, seq: Sequence) -> None:
        """Forget the sequence's shadow and free its blocks (it finished, or no room)."""
        entry = self._shadows.pop(seq.seq_id, None)
        if entry is not None:
            self.kv.free(entry.seq)
