"""The per-request trace (SamplingParams(trace=True)): buckets, prefill chunks, prefix-cache hits,
multi-step windows, queue time, TTFT and per-token times, as the engine ran the request."""

from __future__ import annotations

import pytest

from models.config import get_preset
from models.weights import random_weights
from runtime import SamplingParams
from runtime.engine.plan import compile_plan
from config.engine_config import EngineConfig
from runtime.entrypoints.llm import LLM


@pytest.mark.slow
def test_trace_follows_the_request_through_the_engine():
    cfg = get_preset("tiny")
    plan = compile_plan(None, EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                                           num_kv_blocks=48, num_scheduler_steps=3),
                        weights=random_weights(cfg, seed=0), config=cfg)
    llm = LLM.from_plan(plan, check_invariants=True)
    prompt = list(range(10, 60))  # 50 tokens: two prefill chunks under a 32-token step budget
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, trace=True)
    first = llm.generate([prompt], params)[0].trace
    again = llm.generate([prompt], params)[0].trace  # its whole blocks but the last token's are cached
    untraced = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    assert untraced.trace is None

    assert first["prefill_chunks"] == 2 and first["prefix_cache_hit_tokens"] == 0
    assert [s["tokens"] for s in first["steps"] if s["phase"] == "prefill"] == [32, 18]
    # 1 token from the prefill, then 6 decode tokens in two 3-step windows.
    assert [s["decode_steps"] for s in first["steps"] if s["phase"] == "decode"] == [3, 3]
    assert first["buckets"] and all(len(b) == 2 for b in first["buckets"])
    times = first["token_times_s"][0]
    assert len(times) == 7 and times == sorted(times)
    assert 0 <= first["queue_s"] <= first["ttft_s"] == times[0] <= first["e2e_s"]
    assert first["preemptions"] == 0

    bs = plan.engine.block_size
    hit = (len(prompt) - 1) // bs * bs  # 32 of 50 at the default 32-token blocks
    assert again["prefix_cache_hit_tokens"] == hit
    assert again["prefill_chunks"] == 1 and again["steps"][0]["tokens"] == len(prompt) - hit


def test_trace_over_http(smol_llm):
    """`"trace": true` on a request: the response (and a streamed response's last chunk before
    [DONE]) carries one trace per prompt."""
    import json

    import httpx

    from runtime.serve import ServerThread, build_app

    body = {"prompt": ["The capital of France is", "1, 2, 3,"], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "trace": True}
    with ServerThread(build_app(smol_llm.engine, served_model_names=["m"], log_stats_interval=0)) as st:
        r = httpx.post(st.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        traces = r.json()["trace"]
        assert len(traces) == 2
        for t in traces:
            assert len(t["token_times_s"][0]) == 4 and t["prefill_chunks"] == 1 and t["ttft_s"] > 0
        plain = httpx.post(st.url + "/v1/completions", json=dict(body, trace=False), timeout=120).json()
        assert "trace" not in plain
        with httpx.stream("POST", st.url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
                "trace": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"] == [] and len(last["trace"]) == 1 and last["trace"][0]["steps"]
