"""Requests and their sequences: the host-side state the scheduler and block manager work on."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from runtime.core.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    """One sample stream: its tokens, how many have KV in the cache, and its block table."""

    def __init__(self, request: "Request", token_ids: list[int], index: int = 0):
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index  # which of the request's n samples
        self.prompt_len = len(request.prompt_token_ids)
        self.token_ids = list(token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.block_table: list[int] = []
        # The window group's table (ir.kv_groups; empty without one): its first
        # `num_released_blocks` entries are the null block, behind the window.
        self.window_block_table: list[int] = []
        self.num_released_blocks = 0
        self.num_hashed_blocks = 0
        self.block_hashes: list[int] = []
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.text = ""
        self.detok_state = None  # incremental detokenizer state, owned by the engine
        self.matcher = None  # GrammarMatcher (structured outputs), owned by the engine
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request.request_id}#{self.index}, len={len(self)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestTrace:
    """A request's path through the engine (`SamplingParams(trace=True)`): one entry per step that
    ran one of its sequences, and the time of every token. Times are seconds since arrival."""

    steps: list[dict] = field(default_factory=list)
    token_times: list[list[float]] = field(default_factory=list)  # per sequence index

    def step(self, request: "Request", seq: Sequence, bucket, num_tokens: int, decode_steps: int) -> None:
        self.steps.append({
            "t": round(time.monotonic() - request.metrics.arrival_time, 6), "seq": seq.index,
            "phase": "prefill" if seq.num_computed_tokens < len(seq) - 1 or not seq.num_output_tokens else "decode",
            "bucket": list(bucket), "tokens": num_tokens, "decode_steps": decode_steps,
            "context": seq.num_computed_tokens, "cached_tokens": seq.num_cached_tokens})

    def speculated(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Speculative decoding: the drafts the last step of `seq` verified, and how many it kept."""
        for s in reversed(self.steps):
            if s["seq"] == seq.index:
                s["drafts"], s["accepted"] = num_drafts, num_accepted
                return

    def token(self, request: "Request", seq: Sequence, now: float) -> None:
        while len(self.token_times) <= seq.index:
            self.token_times.append([])
        self.token_times[seq.index].append(round(now - request.metrics.arrival_time, 6))

    def to_dict(self, request: "Request") -> dict:
        m = request.metrics
        since = lambda t: None if t is None else round(t - m.arrival_time, 6)  # noqa: E731
        first = next((s for s in self.steps if s["seq"] == 0), None)
        return {"queue_s": since(m.first_scheduled_time), "ttft_s": since(m.first_token_time),
                "e2e_s": since(m.finished_time),
                "prefix_cache_hit_tokens": first["cached_tokens"] if first else 0,
                "prefill_chunks": sum(1 for s in self.steps if s["phase"] == "prefill"),
                "preemptions": sum(s.num_preemptions for s in request.seqs),
                "buckets": sorted({tuple(s["bucket"]) for s in self.steps}),
                "spec_draft_tokens": sum(s.get("drafts", 0) for s in self.steps),
                "spec_accepted_tokens": sum(s.get("accepted", 0) for s in self.steps),
                "steps": list(self.steps), "token_times_s": [list(t) for t in self.token_times]}


class Request:
    """A user request: one prompt, `params.n` sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = params.priority
        self.metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        self.seqs: list[Sequence] = [Sequence(self, self.prompt_token_ids, 0)]
        self.forked = params.n == 1
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.aborted = False
        self.trace: RequestTrace | None = RequestTrace() if params.trace else None
        self.grammar = None  # CompiledGrammar (structured outputs): each sequence gets a matcher of it
        self.error: str | None = None  # why a sequence of it was ended with finish_reason "error"

    @property
    def is_finished(self) -> bool:
        return self.forked and all(s.is_finished for s in self.seqs)
