"""`Scheduler`: decides, step by step, which sequences run and how many tokens each computes.

Every step spends one token budget: running sequences first (one token per decode, or the next
chunk of an unfinished prefill), then waiting sequences in priority order, whose prompts are
split into chunks when the budget runs short. When the KV cache is full, the lowest-priority,
latest running sequence is preempted (never one more urgent than the sequence that needs the
room): its blocks are freed, its computed tokens swapped to host memory or recomputed when it
resumes (`Preemptor`, by the `preemption_mode` setting and its cost model).

Backfill (sequences at `backfill_priority` or less urgent: batch items) takes what real-time work
leaves: no tokens in a step while a more urgent prompt waits for its first token, and beside
real-time decodes only as many tokens as `StepCost` says keep the step within its slowdown.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from modelyard.engine.kv_cache_manager import KVCacheManager
from modelyard.engine.preemption import Preemptor
from modelyard.engine.sequence import Sequence, SequenceStatus
from modelyard.engine.spec_decode import Drafter
from modelyard.engine.step_cost import StepCost


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    backfill_only: bool = False  # every sequence scheduled is backfill (may stop for real-time)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemptor: Preemptor | None = None,
        step_cost: StepCost | None = None,
        backfill_priority: int | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemptor = preemptor or Preemptor(kv)  # default: always recompute
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.drafter: Drafter | None = None  # speculative decoding, when it is on
        self.step_cost = step_cost or StepCost()
        self.backfill_priority = backfill_priority  # None: no sequence is backfill

    @property
    def num_preemptions(self) -> int:
        return self.preemptor.num_preemptions

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        self.preemptor.discard(seq)
        if self.drafter is not None:
            self.drafter.release(seq)
        seq.status = SequenceStatus.FINISHED

    def _urgent_priority(self) -> int | None:
        """The priority whose first tokens are pending while less urgent sequences run.

        While it is set, a step serves only sequences at least that urgent: an interactive
        request never waits behind a step full of batch decodes for its first token.
        """
        pending = [s.priority for s in self.waiting]
        pending += [s.priority for s in self.running if s.prefilling]
        if not pending:
            return None
        top = min(pending)
        return top if any(s.priority > top for s in self.running) else None

    def _priority_victim(self, than: int, scheduled: set[int]) -> Sequence | None:
        """The least urgent running sequence below `than` that this step has not scheduled."""
        for seq in reversed(self.running):
            if seq.priority > than and id(seq) not in scheduled:
                return seq
        return None

    def _backfill(self, seq: Sequence) -> bool:
        return self.backfill_priority is not None and seq.priority >= self.backfill_priority

    def _spent(
        self, seq: Sequence, tokens: int, realtime: int, backfill: int | None
    ) -> tuple[int, int | None]:
        """The step's real-time tokens and backfill tokens left after `seq` took `tokens`."""
        if not self._backfill(seq):
            self.step_cost.saw_realtime()
            return realtime + tokens, backfill
        return realtime, None if backfill is None else backfill - tokens

    def _speculate(self, seq: Sequence, budget: int) -> bool:
        """Give a decoding sequence its draft and the blocks for it, if it has one and they fit
        without preempting anybody (else it decodes one token as usual)."""
        seq.drop_draft()
        if self.drafter is None or seq.prefilling or budget <= 0:
            return False
        draft = self.drafter(seq, budget)
        if not draft or not self.kv.allocate(seq, 1 + len(draft)):
            seq.draft_probs = None
            return False
        seq.draft = draft
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda s: s.sort_key)
        urgent = self._urgent_priority()
        realtime = 0  # tokens of real-time sequences in this step
        backfill: int | None = None  # backfill tokens left, set at the first backfill sequence

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if urgent is not None and seq.priority > urgent:
                i += 1
                continue
            limit = budget
            if self._backfill(seq):  # sorted by priority: every real-time one came first
                if backfill is None:
                    backfill = self.step_cost.backfill_tokens(realtime)
                limit = min(budget, backfill)
                if limit <= 0:
                    i += 1
                    continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, limit)
            if num_new == 1 and self._speculate(seq, limit - 1):
                out.scheduled.append((seq, 1 + len(seq.draft)))
                budget -= 1 + len(seq.draft)
                realtime, backfill = self._spent(seq, 1 + len(seq.draft), realtime, backfill)
                i += 1
                continue
            while not self.kv.allocate(seq, num_new):
                victim = self.running.pop()  # the least urgent: never more urgent than seq
                self.preemptor.preempt(victim)
                self.add(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                realtime, backfill = self._spent(seq, num_new, realtime, backfill)
                i += 1

        # A step that had to preempt admits nobody new: it would only thrash.
        if out.preempted:
            return out
        scheduled = {id(s) for s, _ in out.scheduled}
        admitted: list[Sequence] = []
        displaced: list[Sequence] = []
        for seq in self.waiting:
            if budget <= 0:
                break
            if urgent is not None and seq.priority > urgent:
                continue
            leader = seq.leader
            if leader is not None and not leader.finished and leader.prefilling:
                continue  # its leader is computing the shared prompt; reuse it next step
            if seq.swap_slots:  # swapped out: its computed tokens come back from the pool
                cached, num_computed = [], seq.num_computed_tokens
            else:
                cached = self.kv.find_cached_prefix(seq)
                num_computed = len(cached) * self.kv.block_size
            limit = budget
            if self._backfill(seq):
                if backfill is None:
                    backfill = self.step_cost.backfill_tokens(realtime)
                limit = min(budget, backfill)
                if limit <= 0:
                    break  # only backfill follows in priority order
            num_new = seq.num_tokens - num_computed
            if num_new > limit:
                num_new = limit  # chunked prefill: the rest of the prompt runs next step
            while len(self.running) + len(admitted) >= self.max_num_seqs or not self.kv.allocate(
                seq, num_new, cached
            ):
                # Room for a more urgent sequence is taken from less urgent ones.
                less_urgent = self._priority_victim(seq.priority, scheduled)
                if less_urgent is None:
                    break
                self.running.remove(less_urgent)
                self.preemptor.preempt(less_urgent)
                displaced.append(less_urgent)
                out.preempted.append(less_urgent)
            else:
                seq.num_computed_tokens = num_computed
                self.preemptor.resume(seq)
                if not seq.admitted:
                    seq.num_cached_tokens = num_computed
                    seq.admitted = True
                    seq.first_scheduled = time.monotonic()
                seq.status = SequenceStatus.RUNNING
                admitted.append(seq)
                out.scheduled.append((seq, num_new))
                budget -= num_new
                realtime, backfill = self._spent(seq, num_new, realtime, backfill)
                continue
            break  # strict priority order: nobody overtakes a sequence that does not fit
        if admitted:
            taken = set(map(id, admitted))
            self.waiting = [s for s in self.waiting if id(s) not in taken]
            self.running.extend(admitted)
        for victim in displaced:
            self.add(victim)
        out.backfill_only = bool(out.scheduled) and realtime == 0  # every row went by `_spent`
        return out
