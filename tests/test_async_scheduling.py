"""Async scheduling (vLLM's name): step N+1 is scheduled and dispatched while step N runs, its
decode tokens taken on the device from N's sampled rows. Outputs must be exactly those of one step
at a time, through stops, aborts, preemption, forks, penalties, grammars and prefix caching, with
no KV block leaked and no recompile."""

from __future__ import annotations

import random

import pytest

from conftest import tiny_bpe_tokenizer, tiny_llm
from runtime import SamplingParams
from config.engine_config import EngineConfig
from runtime.core.sampling_params import StructuredOutputsParams

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=64)


@pytest.fixture(scope="module")
def llms():
    """{True: async, False: one step at a time}, same weights."""
    return {a: tiny_llm(**ENGINE, async_scheduling=a) for a in (True, False)}


def bpe_llms():
    """{async: LLM} over the tiny BPE tokenizer (the tiny model's vocabulary padded to hold it)."""
    from dataclasses import replace

    from models.config import get_preset

    tok = tiny_bpe_tokenizer()
    cfg = replace(get_preset("tiny"), name="tiny-bpe", vocab_size=300, eos_token_id=tok.eos_token_id)
    return {a: tiny_llm(**ENGINE, async_scheduling=a, config=cfg, tokenizer=tok) for a in (True, False)}


def outputs(llm, prompts, params):
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.text)
            for o in llm.generate(prompts, params) for c in o.outputs]


def assert_same(a, b):
    """Tokens, finish and stop reasons and text exactly; logprobs to 1e-5 (a step may run in
    another bucket when a finished sequence's row rides along, which moves f32 by a few ulps)."""
    assert [x[:3] + x[4:] for x in a] == [x[:3] + x[4:] for x in b]
    for x, y in zip(a, b):
        assert (x[3] is None) == (y[3] is None)
        for d, e in zip(x[3] or [], y[3] or []):
            assert d.keys() == e.keys() and all(abs(d[t] - e[t]) <= 1e-5 for t in d)


def no_leaks(llm):
    bm = llm.engine.block_manager
    bm.check_invariants([])
    assert bm.num_used == 0
    assert llm.engine.stats().num_recompiles == 0


@pytest.mark.slow
def test_greedy_seeded_and_forked_outputs_equal_one_step_at_a_time(llms):
    prompts = [list(range(3, 3 + n)) for n in (4, 9, 17, 30, 2)]
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in (1, 5, 11, 13, 22)]
    assert_same(outputs(llms[True], prompts, greedy), outputs(llms[False], prompts, greedy))
    # The per-token seed counter counts the pending token; n=2 forks are sampled on the host
    # first (their first token is not fed), then decode like the rest.
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=10, ignore_eos=True, n=1 + s % 2)
              for s in range(5)]
    assert_same(outputs(llms[True], prompts, seeded), outputs(llms[False], prompts, seeded))
    for llm in llms.values():
        no_leaks(llm)


def test_steps_overlap_and_stopped_rows_are_dropped(llms):
    """Decode steps are launched while the one before runs; a sequence that stops on a token the
    host had not seen yet already has a row in the next step, whose token is thrown away."""
    llm = llms[True]
    prompt = list(range(40, 60))
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    toks = free.outputs[0].token_ids
    stop_at = toks[6]
    engine = llm.engine
    engine.trace = []
    got = outputs(llm, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_at]))
    trace, engine.trace = engine.trace, None
    assert got[0][0] == toks[:toks.index(stop_at) + 1] and got[0][1] == "stop"
    assert sum(t.overlapped for t in trace) >= len(got[0][0]) - 2  # all but the first decode steps
    # The prefill and one step per token kept. The step launched past the stop ran only the
    # stopped sequence: it is dropped unread, not left in flight.
    assert len(trace) == len(got[0][0]) and engine._inflight is None
    no_leaks(llm)


@pytest.mark.slow
def test_stop_strings_min_tokens_and_length_limits():
    llms = bpe_llms()
    tok = llms[True].engine.tokenizer
    prompts = ["ab12 {\"a", "hello", "x"]
    free = outputs(llms[False], prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop = free[0][4][3:5] or "a"  # a piece of the first answer's text, so the stop is hit mid-stream
    params = [SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=7),
              SamplingParams(temperature=0.7, seed=3, ignore_eos=True, max_tokens=128 - len(tok.encode("x")))]
    got = outputs(llms[True], prompts, params)
    assert_same(got, outputs(llms[False], prompts, params))
    assert got[0][1] == "stop" and got[2][1] == "length"
    for llm in llms.values():
        no_leaks(llm)


@pytest.mark.slow
def test_penalties_and_grammars_fall_back_and_match(llms):
    """Rows whose next sampling reads the token on the host (penalties, a grammar's mask) get no
    pending token; they decode one step later, with the same outputs."""
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]
    assert_same(outputs(llms[True], prompts, params), outputs(llms[False], prompts, params))
    gl = bpe_llms()
    schema = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"ab": {"enum": [12, 21]}}, "required": ["ab"]}))
    plain = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    got = outputs(gl[True], ["{", "ab"], [schema, plain])
    assert_same(got, outputs(gl[False], ["{", "ab"], [schema, plain]))
    for llm in gl.values():
        no_leaks(llm)


@pytest.mark.slow
def test_preemption_aborts_and_prefix_hits_under_a_random_workload():
    """A tight KV pool (preemption while a token is pending), aborts between steps (of requests
    whose next step is already running), prefix hits on shared prefixes, greedy and seeded rows,
    n=2 forks: the finished requests' outputs equal one step at a time, and the block manager
    stays consistent after every step."""
    results = {}
    for a in (True, False):
        llm = tiny_llm(**dict(ENGINE, num_kv_blocks=16), async_scheduling=a, enable_prefix_caching=True)
        engine = llm.engine
        rng = random.Random(11)
        shared = [rng.randrange(3, 256) for _ in range(40)]
        done, aborted = {}, set()
        for i in range(24):
            prompt = (shared[:rng.randint(0, 40)] + [rng.randrange(3, 256) for _ in range(rng.randint(1, 30))])
            engine.add_request(f"r{i}", prompt, SamplingParams(
                temperature=rng.choice([0, 0.8]), seed=i, n=rng.choice([1, 1, 2]), max_tokens=rng.randint(1, 40),
                logprobs=rng.choice([None, 1]), ignore_eos=True))
        step = 0
        while engine.has_unfinished_requests():
            if step in (3, 8, 9, 20):
                rid = f"r{step}"
                engine.abort_request(rid)
                aborted.add(rid)
            for out in engine.step():  # check_invariants=True asserts after every step
                if out.finished:
                    done[out.request_id] = [o.token_ids for o in out.outputs]
            step += 1
            assert step < 2000
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.stats.hits > 0
        assert all(-1 not in t for ts in done.values() for t in ts)
        no_leaks(llm)
        results[a] = {k: v for k, v in done.items() if k not in aborted}
    assert results[True] == results[False]


def test_config_auto_and_conflicts():
    """auto: on for accelerators, off on CPU (the host's work would share the step's cores:
    docs/benchmarks/, "Async scheduling"), and off where it does not apply."""
    assert EngineConfig().schedules_async("gpu") and not EngineConfig().schedules_async("cpu")
    assert EngineConfig(async_scheduling=True).schedules_async("cpu")
    assert not EngineConfig(num_scheduler_steps=4).schedules_async("gpu")
    assert not EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).schedules_async("gpu")
    assert not EngineConfig(tensor_parallel_size=2).schedules_async("gpu")
    assert not EngineConfig(async_scheduling=False).schedules_async("gpu")
    with pytest.raises(ValueError, match="async_scheduling does not combine with num_scheduler_steps > 1"):
        EngineConfig(async_scheduling=True, num_scheduler_steps=4)
    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        EngineConfig(async_scheduling="yes")
