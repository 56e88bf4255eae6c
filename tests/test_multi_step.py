"""Multi-step decode (vLLM's num_scheduler_steps): K decode steps in one executable give exactly
the single-step outputs, stops inside the K window included, with the block manager consistent."""

from __future__ import annotations

import pytest

from conftest import tiny_llm
from runtime import SamplingParams

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=64)


@pytest.fixture(scope="module")
def llms():
    return {k: tiny_llm(**ENGINE, num_scheduler_steps=k) for k in (1, 4)}


def outputs(llm, prompts, params):
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
            for o in llm.generate(prompts, params) for c in o.outputs]


def assert_same(a, b):
    """Tokens, finish and stop reasons exactly; logprobs to 1e-5 (the step inside the K-step loop
    is fused differently by XLA, which moves f32 results by a few ulps)."""
    assert [x[:3] for x in a] == [x[:3] for x in b]
    for x, y in zip(a, b):
        assert (x[3] is None) == (y[3] is None)
        for d, e in zip(x[3] or [], y[3] or []):
            assert d.keys() == e.keys() and all(abs(d[t] - e[t]) <= 1e-5 for t in d)


@pytest.mark.slow
def test_greedy_and_seeded_outputs_equal_single_step(llms):
    prompts = [list(range(3, 3 + n)) for n in (4, 9, 17, 30, 2)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in (1, 5, 11, 13, 22)]
    assert_same(outputs(llms[4], prompts, params), outputs(llms[1], prompts, params))
    # Seeded sampling (the per-token seed counter advances inside the window), n=2 forks sharing
    # the prompt's blocks (copy-on-write before the window).
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=10, ignore_eos=True, n=1 + s % 2)
              for s in range(5)]
    assert_same(outputs(llms[4], prompts, seeded), outputs(llms[1], prompts, seeded))
    for llm in llms.values():
        assert llm.engine.stats().num_recompiles == 0
        assert llm.engine.block_manager.num_used == 0


def test_stops_inside_the_window_drop_the_tokens_after_them(llms):
    """A stop token id and max_tokens landing mid-window end the sequence exactly where one step
    at a time would; what the device computed past them is thrown away."""
    prompt = list(range(40, 60))
    free = llms[1].generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    toks = free.outputs[0].token_ids
    stop_at = toks[6]  # a token sampled 7th: the 2nd of the second 4-step window
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    got = outputs(llms[4], [prompt, prompt], params)
    assert_same(got, outputs(llms[1], [prompt, prompt], params))
    first = got[0]
    assert first[1] == "stop" and first[0][-1] == stop_at and len(first[0]) == toks.index(stop_at) + 1
    assert len(got[1][0]) == 7


def test_multi_step_runs_and_falls_back_where_it_must(llms):
    """All-decode batches run K steps per executable; penalties (which read the growing history)
    fall back to one step at a time and still match."""
    engine = llms[4].engine
    engine.trace = []
    llms[4].generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    # 1 prefill step, then 8 more tokens in 2 windows of 4.
    assert len(engine.trace) == 3
    engine.trace = None
    pen = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, repetition_penalty=1.3)
    assert_same(outputs(llms[4], [[5, 6, 7]], pen), outputs(llms[1], [[5, 6, 7]], pen))
