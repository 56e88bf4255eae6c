"""/metrics over real HTTP on a tiny random model: every vLLM V1 metric name is there, and each value is
what the requests sent and the engine did (token counts, n, max_tokens, finish reasons, steps)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.engine.async_engine import _waiting_by_reason
from runtime.core.block_manager import BlockManager
from runtime.core.buckets import BucketTable
from config.engine_config import resolve_dtype
from runtime.core.sampling_params import SamplingParams
from runtime.core.scheduler import Scheduler, SchedulerConfig
from runtime.core.sequence import Request
from runtime.serve import ServerThread, build_app

MODEL = "tiny"

# vLLM's tests/entrypoints/openai/test_metrics.py EXPECTED_METRICS_V1, less the names it hides by default
# (deprecated: gpu_cache_usage_perc, gpu_prefix_cache_*, time_per_output_token_seconds).
VLLM_EXPECTED = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:iteration_tokens_total",
    "vllm:cache_config_info", "vllm:request_success_total",
    *[f"vllm:{h}_{suffix}" for h in (
        "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
        "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds") for suffix in ("sum", "bucket", "count")],
]
# Newer vLLM V1 names (vllm/v1/metrics/loggers.py) that vLLM's test list does not check yet.
VLLM_NEWER = ["vllm:num_requests_waiting_by_reason", "vllm:request_max_num_generation_tokens_count",
              "vllm:request_time_per_output_token_seconds_count", "vllm:request_prefill_kv_computed_tokens_count",
              "vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_cached_total"]


@pytest.fixture(scope="module")
def tiny_engine():
    from models.config import get_preset
    from models.weights import random_weights
    from runtime.tools.compile import compile_plan
    from config.engine_config import EngineConfig
    from runtime.entrypoints.llm import LLM

    cfg = get_preset("tiny")
    plan = compile_plan(None, EngineConfig(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                                           num_kv_blocks=64), weights=random_weights(cfg, seed=0), config=cfg)
    return LLM.from_plan(plan, check_invariants=True).engine


class StepCounter:
    """An engine step hook: counts steps; sleeps in each while `slow` is set (so an abort lands mid-request)."""

    def __init__(self):
        self.num_steps = 0
        self.slow = threading.Event()

    def __call__(self, sched, outs):
        self.num_steps += 1
        if self.slow.is_set():
            time.sleep(0.02)


def scrape(http: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client: {name{sorted labels}: value}."""
    r = http.get("/metrics")
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(http: httpx.Client, engine, timeout: float = 30.0, until=lambda m: True) -> dict[str, float]:
    """Scrapes /metrics until nothing runs or waits and `until(metrics)` holds. The engine counts a
    finished or aborted request in its callback just after dropping it from its table, so a scrape
    can see it idle a moment before the counter moves (CI caught that window once for an abort)."""
    t0 = time.monotonic()
    while True:
        m = scrape(http)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 \
                and not engine.has_unfinished_requests() and until(m):
            return m
        assert time.monotonic() - t0 < timeout, "server did not go idle"
        time.sleep(0.05)


def test_metrics_carry_what_the_requests_sent(tiny_engine):
    engine = tiny_engine
    counter = StepCounter()
    engine.step_hooks.append(counter)
    app = build_app(engine, served_model_names=[MODEL], log_stats_interval=0)
    bs = engine.block_manager.block_size
    long_prompt = [(7 * i) % 200 + 3 for i in range(bs + 4)]  # one full block: a prefix-cache hit next time
    short_prompt = [11, 12, 13, 14, 15, 16, 17]
    try:
        with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=60) as http:
            m0 = scrape(http)
            steps0 = engine.num_steps
            base = {"model": MODEL, "ignore_eos": True}
            r1 = http.post("/v1/completions", json={**base, "prompt": long_prompt, "max_tokens": 4,
                                                    "temperature": 0, "return_token_ids": True}).json()
            assert r1["choices"][0]["finish_reason"] == "length"
            first = r1["choices"][0]["token_ids"][0]
            r2 = http.post("/v1/completions", json={**base, "prompt": short_prompt, "max_tokens": 3, "n": 2,
                                                    "temperature": 1.0, "seed": 5}).json()
            assert [c["finish_reason"] for c in r2["choices"]] == ["length", "length"]
            # The same prompt, greedy: its first token is a stop token now, and its full block is cached.
            r3 = http.post("/v1/completions", json={**base, "prompt": long_prompt, "max_tokens": 4,
                                                    "temperature": 0, "stop_token_ids": [first]}).json()
            assert r3["choices"][0]["finish_reason"] == "stop" and r3["usage"]["completion_tokens"] == 1
            # A stream the client drops after its first chunk: the engine aborts it.
            counter.slow.set()
            with http.stream("POST", "/v1/completions", json={**base, "prompt": [5, 6, 7, 8, 9], "stream": True,
                                                               "max_tokens": 58, "temperature": 0}) as r:
                next(r.iter_lines())
            aborts = "vllm:request_success_total{finished_reason=abort}"
            text_m = wait_idle(http, engine, until=lambda m: m.get(aborts, 0.0) > m0.get(aborts, 0.0))
            counter.slow.clear()
            raw = http.get("/metrics").text
    finally:
        engine.step_hooks.remove(counter)

    m = {k: v - m0.get(k, 0.0) for k, v in text_m.items()}  # what these requests added
    for name in VLLM_EXPECTED + VLLM_NEWER:
        assert name in raw, f"{name} not in /metrics"  # vLLM's own check

    # Finished samples: r1 (1), r2 (2), r3 (1); the aborted stream only counts as an abort.
    assert m["vllm:request_success_total{finished_reason=length}"] == 3
    assert m["vllm:request_success_total{finished_reason=stop}"] == 1
    assert m["vllm:request_success_total{finished_reason=abort}"] == 1
    p_long, p_short = len(long_prompt), len(short_prompt)
    assert (m["vllm:request_prompt_tokens_count"], m["vllm:request_prompt_tokens_sum"]) == (4, 2 * p_long + 2 * p_short)
    assert (m["vllm:request_generation_tokens_count"], m["vllm:request_generation_tokens_sum"]) == (4, 4 + 3 + 3 + 1)
    assert (m["vllm:request_params_max_tokens_count"], m["vllm:request_params_max_tokens_sum"]) == (4, 4 + 3 + 3 + 4)
    # n is per request: observations 1, 2 and 1
    assert (m["vllm:request_params_n_count"], m["vllm:request_params_n_sum"]) == (3, 4)
    assert m["vllm:request_params_n_bucket{le=1.0}"] == 2 and m["vllm:request_params_n_bucket{le=2.0}"] == 3
    assert (m["vllm:request_max_num_generation_tokens_count"],
            m["vllm:request_max_num_generation_tokens_sum"]) == (3, 4 + 3 + 1)
    # KV computed: r1 all of its prompt, r2's first sample its prompt and its second none, r3 all but the block
    assert m["vllm:request_prefill_kv_computed_tokens_sum"] == p_long + p_short + 0 + (p_long - bs)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert m[f"vllm:{name}_count"] == 4, name
    assert abs(m["vllm:request_prefill_time_seconds_sum"] + m["vllm:request_decode_time_seconds_sum"]
               - m["vllm:request_inference_time_seconds_sum"]) < 1e-6
    assert m["vllm:request_inference_time_seconds_sum"] > 0

    # One observation per engine step; its tokens are vLLM's: prompts whose prefill ended plus tokens generated.
    assert m["vllm:iteration_tokens_total_count"] == engine.num_steps - steps0 > 0
    assert m["vllm:iteration_tokens_total_sum"] == m["vllm:prompt_tokens_total"] + m["vllm:generation_tokens_total"]
    assert m["vllm:prompt_tokens_total"] == 2 * p_long + p_short + 5  # n=2 shares one prefill
    assert m["vllm:generation_tokens_total"] >= 4 + 3 + 3 + 1 + 1
    assert m["vllm:prompt_tokens_cached_total"] == bs == m["vllm:prompt_tokens_by_source_total{source=local_cache_hit}"]
    assert m["vllm:prompt_tokens_by_source_total{source=local_compute}"] == m["vllm:prompt_tokens_total"] - bs
    assert m["vllm:prefix_cache_hits_total"] >= bs

    # Gauges, idle now
    assert text_m["vllm:num_requests_waiting_by_reason{reason=capacity}"] == 0
    assert text_m["vllm:num_requests_waiting_by_reason{reason=deferred}"] == 0
    assert text_m["vllm:kv_cache_usage_perc"] == 0
    info = [k for k in text_m if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and text_m[info[0]] == 1
    bm = engine.block_manager
    labels = dict(kv.split("=", 1) for kv in info[0][len("vllm:cache_config_info{"):-1].split(","))
    assert labels == {"block_size": str(bm.block_size), "num_gpu_blocks": str(bm.num_blocks),
                      "enable_prefix_caching": str(bm.enable_prefix_caching),
                      "cache_dtype": resolve_dtype(engine.engine_config.dtype),
                      "gpu_memory_utilization": str(engine.engine_config.memory_utilization)}


def _seqs(sched: Scheduler, n: int) -> None:
    for i in range(n):
        sched.add(Request(f"r{i}", None, [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=float(i)).seqs[0])


@pytest.mark.parametrize("policy,admitted,want", [
    ("continuous", 0, (5, 0)),  # waiting under continuous batching means no room this step
    ("static", 0, (0, 5)),  # a static batch of 8 still forming: the policy holds them
    ("static", 3, (3, 2)),  # 3 admitted to the forming batch but not yet placed; 2 wait for the next batch
])
def test_waiting_by_reason(policy, admitted, want):
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
                                      scheduling=policy), BlockManager(16, 4), BucketTable.build(32, 8))
    _seqs(sched, 5)
    sched._batch_quota = admitted
    assert _waiting_by_reason(sched) == want


def test_request_num_preemptions_histogram():
    """vLLM's vllm:request_num_preemptions: one observation per finished sequence, its preemptions.
    Eight 48-token sequences on a pool of 12 eight-token blocks (each needs 6): the scheduler preempts
    some, and the histogram's sum is the engine's vllm:num_preemptions_total."""
    from conftest import tiny_llm

    engine = tiny_llm(seed=0, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, block_size=8,
                      num_kv_blocks=12).engine
    app = build_app(engine, served_model_names=[MODEL], log_stats_interval=0)
    with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=120) as http:
        m0 = scrape(http)
        assert m0["vllm:request_num_preemptions_count"] == 0
        body = {"model": MODEL, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
        threads = [threading.Thread(target=http.post, args=("/v1/completions",),
                                    kwargs={"json": {**body, "prompt": [3 + i, 4, 5, 6, 7, 8, 9, 10]}})
                   for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        m = wait_idle(http, engine, until=lambda m: m["vllm:request_num_preemptions_count"] == 8)
    total = m["vllm:num_preemptions_total"] - m0["vllm:num_preemptions_total"]
    assert total > 0 and m["vllm:request_num_preemptions_sum"] == total
    assert m["vllm:request_num_preemptions_bucket{le=0.0}"] < 8  # some sequence was preempted
    assert m["vllm:request_num_preemptions_bucket{le=+Inf}"] == 8
