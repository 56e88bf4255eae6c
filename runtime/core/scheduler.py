"""The scheduler: which sequences run this step, how many tokens each, padded to which bucket.

Plain Python, no JAX. Policies: `continuous` (join and leave every step), `dynamic` (a batch
forms within a waiting window, then runs to completion) and `static` (wait for N requests,
then run them to completion).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from runtime.core.block_manager import BlockManager
from runtime.core.buckets import BucketTable
from runtime.core.sequence import Sequence, SeqStatus

POLICIES = ("continuous", "dynamic", "static")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    scheduling: str = "continuous"
    max_waiting_ms: float = 50.0
    static_batch_size: int | None = None  # defaults to max_num_seqs

    def __post_init__(self):
        if self.scheduling not in POLICIES:
            raise ValueError(f"scheduling must be one of {POLICIES}, got {self.scheduling!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so its last logits are sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)

    @property
    def num_rows(self) -> int:
        """Sampler rows this chunk needs: n for a prompt about to fork into n samples."""
        if not self.samples:
            return 0
        req = self.seq.request
        return 1 if req.forked else req.params.n


@dataclass
class ScheduleOutput:
    scheduled: list[ScheduledSeq]
    num_tokens: int
    bucket: tuple[int, int]
    copies: list[tuple[int, int]] = field(default_factory=list)
    window_copies: list[tuple[int, int]] = field(default_factory=list)  # the window group's (ir.kv_groups)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, buckets: BucketTable):
        self.config = config
        self.bm = block_manager
        self.buckets = buckets
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._batch_quota = 0  # static/dynamic: members of the forming batch still to admit
        self.no_more_arrivals = False  # offline: everything has been submitted

    # ------------------------------------------------------------------ queue

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def _queue_key(self, seq: Sequence):
        r = seq.request
        return (r.priority, r.metrics.arrival_time, seq.seq_id)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.deallocate(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_admissible(self) -> int:
        """Waiting sequences the batching policy would admit now if capacity allowed: all of them
        under continuous batching; under static/dynamic, what is left of the forming batch."""
        return len(self.waiting) if self.config.scheduling == "continuous" else self._batch_quota

    def queue_order(self) -> list[Sequence]:
        """The waiting sequences in the order they are admitted (priority, then arrival)."""
        return sorted(self.waiting, key=self._queue_key)

    # ------------------------------------------------------------------ policy gates

    def _admission_quota(self, now: float) -> int:
        """How many more sequences may join now.

        Continuous: any number. Static and dynamic form a batch only when nothing runs (static
        once N requests wait, dynamic once the waiting window closes); the batch may take several
        steps to prefill, and then runs to completion with no one joining.
        """
        c = self.config
        if c.scheduling == "continuous":
            return len(self.waiting)
        if not self.running and not self._batch_quota and self.waiting:
            if c.scheduling == "static":
                n = c.static_batch_size or c.max_num_seqs
                if len(self.waiting) >= n or self.no_more_arrivals:
                    self._batch_quota = min(n, len(self.waiting))
            else:
                oldest = min(s.request.metrics.arrival_time for s in self.waiting)
                if (len(self.waiting) >= c.max_num_seqs or self.no_more_arrivals
                        or (now - oldest) * 1000 >= c.max_waiting_ms):
                    self._batch_quota = min(c.max_num_seqs, len(self.waiting))
        return self._batch_quota

    # ------------------------------------------------------------------ schedule

    def _preempt(self, victim: Sequence, out: ScheduleOutput) -> None:
        """Recompute-style preemption: drop its KV, keep its tokens, send it back to the queue."""
        self.running.remove(victim)
        self.bm.deallocate(victim)
        victim.status = SeqStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(victim)
        out.preempted.append(victim)

    def schedule(self) -> ScheduleOutput:
        c = self.config
        now = time.monotonic()
        out = ScheduleOutput([], 0, (0, 0))
        token_budget = min(c.max_num_batched_tokens, self.buckets.max_tokens)
        seq_budget = min(c.max_num_seqs, self.buckets.max_seqs)

        # 1. Running sequences first, oldest first, so decodes never wait behind new prompts.
        self.running.sort(key=self._queue_key)
        i = 0
        while i < len(self.running) and token_budget > 0 and seq_budget > 0:
            seq = self.running[i]
            n = seq.num_uncomputed
            if n == 0:  # async scheduling: its next token is not sampled yet
                i += 1
                continue
            if n > token_budget:
                if not c.enable_chunked_prefill:
                    i += 1
                    continue
                n = token_budget
            while not self.bm.can_append(seq, n):
                victim = self.running[-1]  # youngest
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING:
                continue  # preempted itself; self.running shrank
            self.bm.may_append(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n))
            token_budget -= n
            seq_budget -= 1 if seq.request.forked else seq.request.params.n
            i += 1

        # 2. Then waiting ones, in priority then arrival order.
        quota = self._admission_quota(now) if not out.preempted else 0
        if quota:
            self.waiting.sort(key=self._queue_key)
            while self.waiting and token_budget > 0 and seq_budget > 0 and quota > 0:
                seq = self.waiting[0]
                if seq.request.params.n > seq_budget and not (seq.request.forked or seq.index):
                    break  # its samples will need n sequence slots
                if not self.bm.can_allocate(seq, token_budget):
                    break
                self.bm.allocate(seq, token_budget)
                n = seq.num_uncomputed
                if n > token_budget:
                    if not c.enable_chunked_prefill:
                        self.bm.deallocate(seq)
                        break
                    n = token_budget
                self.waiting.pop(0)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                if seq.request.metrics.first_scheduled_time is None:
                    seq.request.metrics.first_scheduled_time = now
                out.scheduled.append(ScheduledSeq(seq, n))
                token_budget -= n
                seq_budget -= 1 if seq.request.forked else seq.request.params.n
                quota -= 1
                if self.config.scheduling != "continuous":
                    self._batch_quota -= 1

        out.num_tokens = sum(s.num_new_tokens for s in out.scheduled)
        if out.scheduled:
            rows = sum(s.num_rows for s in out.scheduled)
            out.bucket = self.buckets.pick(out.num_tokens, max(len(out.scheduled), rows))
        out.copies = self.bm.take_copies()
        out.window_copies = self.bm.take_window_copies()
        return out

    def update(self, out: ScheduleOutput) -> None:
        """After the step ran: advance computed counts and publish full blocks to the prefix cache."""
        for s in out.scheduled:
            if s.seq.is_finished:  # async scheduling: it stopped on the step before this one
                continue
            s.seq.num_computed_tokens += s.num_new_tokens
            self.bm.mark_computed(s.seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:  # async scheduling: preempted while its last token was sampled
            self.waiting.remove(seq)
        self.bm.deallocate(seq)
