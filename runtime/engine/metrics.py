"""Prometheus metrics with vLLM's names, read from engine snapshots taken on the engine thread."""

from __future__ import annotations

from dataclasses import dataclass


TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]


def _1_2_5_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


PREEMPTION_BUCKETS = [0, 1, 2, 3, 4, 5, 10, 20]  # preemptions per finished sequence
# vLLM's fixed buckets for tokens per engine step (fixed, so histograms from several servers add up).
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
WAITING_REASONS = ("capacity", "deferred")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit")  # no KV transfer here: no external_kv_transfer


@dataclass
class Snapshot:
    """Engine counters as of the last step, taken on the engine thread (the HTTP side only reads it)."""

    time: float = 0.0
    num_running: int = 0  # requests, not sequences (vLLM counts requests)
    num_waiting: int = 0
    # num_waiting split as vLLM does: waiting for batch capacity (token/sequence budget, KV blocks), or
    # held back by the batching policy (static/dynamic: a batch is forming or running to completion).
    num_waiting_capacity: int = 0
    num_waiting_deferred: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_recompiles: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_cached: int = 0  # of prompt_tokens_total, found in the prefix cache
    generation_tokens_total: int = 0
    padding_waste_ratio: float = 0.0
    num_kv_blocks: int = 0
    num_cached_blocks: int = 0
    # Speculative decoding (None when the engine has no speculative_config: vLLM exports these only then).
    spec_num_drafts: int | None = None
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


class Metrics:
    """Prometheus metrics in a registry of their own, so several apps can live in one process."""

    def __init__(self, model_name: str, snapshot_fn, *, max_model_len: int = 1 << 16,
                 cache_config: dict | None = None):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._snapshot = snapshot_fn
        self.cache_config = cache_config or {}
        labels = ["model_name"]
        h = lambda name, doc, buckets: Histogram(name, doc, labels, buckets=buckets,  # noqa: E731
                                                 registry=self.registry).labels(model_name)
        # Per finished sequence, as vLLM counts each of a request's n samples as a request of its own
        # (a parallel-sampling child); n and max_num_generation_tokens are per request.
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token, from arrival.", TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Time between successive token steps.", ITL_BUCKETS)
        self.tpot = h("vllm:request_time_per_output_token_seconds",
                      "Decode time over generated tokens - 1, per finished sequence (0 for one token).", ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.queue = h("vllm:request_queue_time_seconds", "Time from arrival to first scheduled (WAITING).",
                       E2E_BUCKETS)
        self.prefill_time = h("vllm:request_prefill_time_seconds", "Time from first scheduled to first token "
                              "(PREFILL).", E2E_BUCKETS)
        self.decode_time = h("vllm:request_decode_time_seconds", "Time from first token to last token (DECODE).",
                             E2E_BUCKETS)
        self.inference_time = h("vllm:request_inference_time_seconds", "Time from first scheduled to last "
                                "token (RUNNING).", E2E_BUCKETS)
        tokens = _1_2_5_buckets(max_model_len)
        self.req_prompt_tokens = h("vllm:request_prompt_tokens", "Prompt tokens of each finished sequence.", tokens)
        self.req_generation_tokens = h("vllm:request_generation_tokens", "Generated tokens of each finished "
                                       "sequence.", tokens)
        self.req_prefill_kv_computed = h("vllm:request_prefill_kv_computed_tokens", "Prompt tokens whose KV was "
                                         "computed (not found in the prefix cache), per finished sequence; a "
                                         "sample that shares its request's prompt blocks computed none.", tokens)
        self.req_params_n = h("vllm:request_params_n", "The n of each finished request.", [1, 2, 5, 10, 20])
        self.req_params_max_tokens = h("vllm:request_params_max_tokens", "The max_tokens of each finished "
                                       "sequence.", tokens)
        self.req_max_num_generation_tokens = h("vllm:request_max_num_generation_tokens", "The most tokens one "
                                               "sample of each finished request generated.", tokens)
        self.req_num_preemptions = h("vllm:request_num_preemptions", "Times each finished sequence was "
                                     "preempted (its KV freed, to be recomputed).", PREEMPTION_BUCKETS)
        self.iteration_tokens = h("vllm:iteration_tokens_total", "Tokens per engine step: prompt tokens whose "
                                  "prefill finished in it plus tokens it generated.", ITERATION_TOKENS_BUCKETS)
        self.success = Counter("vllm:request_success", "Finished sequences by finish reason.",
                               labels + ["finished_reason"], registry=self.registry)
        self.rejected = Counter("vllm:request_rejected", "Requests refused before reaching the engine.",
                                labels + ["reason"], registry=self.registry)
        self.tool_outputs = Counter("jaxserve:tool_call_outputs", "Chat outputs read for tool calls, by "
                                    "tool_choice mode and outcome: parsed (one call or more), malformed (a call's "
                                    "marker, or a constrained output, that gave no call), no_call.",
                                    labels + ["mode", "outcome"], registry=self.registry)
        self.registry.register(self)

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s: Snapshot = self._snapshot()
        m = self.model_name

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([m], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([m], value)
            return c

        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's settings (labels; value 1).",
                                 labels=sorted(self.cache_config))
        info.add_metric([str(self.cache_config[k]) for k in sorted(self.cache_config)], 1)
        yield info
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        by_reason = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Waiting requests by reason: "
                                      "'capacity' = waiting for batch capacity (token or sequence budget, KV "
                                      "blocks); 'deferred' = held back by the batching policy (static/dynamic). "
                                      "They add up to vllm:num_requests_waiting.", labels=["model_name", "reason"])
        for reason, value in zip(WAITING_REASONS, (s.num_waiting_capacity, s.num_waiting_deferred)):
            by_reason.add_metric([m, reason], value)
        yield by_reason
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = 100%); cached-only "
                    "blocks are free.", s.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Sequences preempted (recompute).", s.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prompt tokens of requests whose prefill finished (cached ones "
                      "included).", s.prompt_tokens_total)
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "vllm:prompt_tokens by where their KV "
                                        "came from.", labels=["model_name", "source"])
        for source, value in zip(PROMPT_TOKEN_SOURCES, (s.prompt_tokens_total - s.prompt_tokens_cached,
                                                        s.prompt_tokens_cached)):
            by_source.add_metric([m, source], value)
        yield by_source
        yield counter("vllm:prompt_tokens_cached", "Prompt tokens found in the prefix cache.",
                      s.prompt_tokens_cached)
        yield counter("vllm:generation_tokens", "Generation tokens produced.", s.generation_tokens_total)
        yield counter("recompiles", "XLA compilations after warm-up (must stay 0).", s.num_recompiles)
        yield gauge("padding_waste_ratio", "Fraction of bucket token slots that were padding.",
                    s.padding_waste_ratio)
        yield gauge("kv_cached_blocks", "KV blocks holding prefix-cache content only.", s.num_cached_blocks)
        if s.spec_num_drafts is not None:
            yield counter("vllm:spec_decode_num_drafts", "Verify steps of a sequence that had drafts.",
                          s.spec_num_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_num_draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          s.spec_num_accepted_tokens)
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, "
                                          "by draft position.", labels=["model_name", "position"])
            for pos, value in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([m, str(pos)], value)
            yield per_pos

