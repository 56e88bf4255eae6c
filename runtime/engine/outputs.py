"""What the engine returns: per-request outputs, engine stats snapshots, and per-step traces."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: object = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when a failed step ended this request
    trace: dict | None = None  # SamplingParams(trace=True): RequestTrace.to_dict()


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_recompiles: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prompt_throughput: float  # tok/s, averaged since the engine started
    generation_throughput: float
    padded_tokens_total: int
    scheduled_tokens_total: int
    num_kv_blocks: int
    num_cached_blocks: int
    # Speculative decoding (vLLM's spec_decode counters): verify steps of a sequence with drafts,
    # drafts proposed, drafts accepted, and acceptances by draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def padding_waste_ratio(self) -> float:
        total = self.padded_tokens_total
        return (total - self.scheduled_tokens_total) / total if total else 0.0


@dataclass
class StepTrace:
    """Per-step timing and occupancy, for the benchmark's plots and profiles."""

    time: float
    bucket: tuple[int, int]
    num_tokens: int
    num_seqs: int
    num_sampled: int  # tokens sampled (one per sequence that reached its end this step)
    kv_used_slots: int  # slots that hold real tokens
    kv_allocated_slots: int  # slots of allocated blocks
    # Where the step's wall time went, in order:
    schedule_s: float  # drain adds/aborts, schedule (host)
    prepare_s: float  # build the step's and the sampler's input arrays (host)
    dispatch_s: float  # copy-on-write and the step call, until it returns (async: host side of the launch)
    device_s: float  # waiting for the sampled tokens: the device's share not hidden by the host work
    postprocess_s: float  # prompt logprobs, append tokens, stops, detokenize, outputs (host)
    # Async scheduling: this step was scheduled, prepared and dispatched while the one before it
    # ran, so its schedule/prepare/dispatch time was hidden behind the device.
    overlapped: bool = False

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.dispatch_s + self.postprocess_s
