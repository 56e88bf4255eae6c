"""`jaxserve bench` (runtime/tools/bench.py) on the tiny model: requests arriving at a rate, and a share of
them constrained to a JSON schema, each against the plain all-at-once run."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest

from conftest import tiny_bpe_tokenizer
from runtime.tools import bench


@pytest.fixture(scope="module")
def tiny():
    from models.config import get_preset
    from models.weights import random_weights
    from runtime.engine.build import build_runner
    from config.engine_config import EngineConfig
    from runtime.engine.plan import compile_plan

    tok = tiny_bpe_tokenizer()
    cfg = replace(get_preset("tiny"), name="tiny-bpe", vocab_size=300, eos_token_id=tok.eos_token_id)
    plan = compile_plan(None, EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                                           num_kv_blocks=64), weights=random_weights(cfg, seed=0), config=cfg,
                        tokenizer=tok)
    runner = build_runner(plan)
    runner.warmup()
    work = [(np.random.default_rng(i).integers(3, 250, 5 + 3 * i).tolist(), 10 + i) for i in range(6)]
    return plan, runner, tok, work


def test_arrivals_at_a_rate_are_spread_and_timed(tiny):
    plan, runner, tok, work = tiny
    arrivals = bench.arrival_times(len(work), 20.0)
    assert np.all(np.diff(arrivals) > 0) and not bench.arrival_times(3, float("inf")).any()
    at_once = bench.run_engine(plan, runner, "continuous", work, tok)
    rated = bench.run_engine(plan, runner, "continuous", work, tok, request_rate=20.0)
    assert at_once.ttft_s == [] and len(rated.ttft_s) == len(work) and min(rated.ttft_s) > 0
    assert rated.elapsed_s >= arrivals[-1]  # the last request could not start before it arrived
    assert rated.output_tokens == at_once.output_tokens == sum(m for _, m in work)
    static = bench.run_engine(plan, runner, "static", work, tok, request_rate=50.0)  # waits for arrivals, ends
    assert static.output_tokens == at_once.output_tokens


def test_structured_runs_generate_the_same_tokens_as_free_ones(tiny):
    plan, runner, tok, work = tiny
    assert bench.constrained_requests(6, 0.5) == [False, True, False, True, False, True]
    assert sum(bench.constrained_requests(32, 0.25)) == 8 and not any(bench.constrained_requests(5, 0.0))
    free = bench.run_engine(plan, runner, "continuous", work, tok)
    traces = []
    constrained = bench.run_engine(plan, runner, "continuous", work, tok, traces, structured_fraction=0.5,
                                   name="continuous+json")
    assert constrained.output_tokens == free.output_tokens  # the schema outlasts every max_tokens
    assert {t["policy"] for t in traces} == {"continuous+json"}
    out = io.StringIO()
    bench.report([free, constrained], out=out)
    assert "structured outputs (continuous+json):" in out.getvalue()


def test_policies_on_one_schedule_get_no_ratio(tiny):
    """All at once, static and dynamic batching form the same batches: the report says they ran one
    schedule instead of printing a ratio of noise; continuous (6 requests, 4 slots) differs."""
    plan, runner, tok, work = tiny
    runs = [bench.run_engine(plan, runner, p, work, tok) for p in ("static", "dynamic", "continuous")]
    static, dynamic, continuous = runs
    assert static.schedule == dynamic.schedule != continuous.schedule != ""
    out = io.StringIO()
    bench.report(runs, out=out)
    text = out.getvalue()
    assert f"static and dynamic ran one identical schedule ({static.num_steps} steps)" in text
    assert "continuous / static output throughput" in text and "continuous / dynamic output throughput" in text
    assert "continuous and" not in text
    same = replace(continuous, name="continuous")
    out = io.StringIO()
    bench.report([replace(static, schedule=continuous.schedule), same], out=out)
    assert "continuous / static" not in out.getvalue()
