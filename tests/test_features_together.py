"""Every engine feature on at once: multi-step decode, n-gram speculation, prefix caching, traces,
penalties, n > 1, logprobs and a grammar-constrained request in one batch give the tokens of an
engine with every feature off, with no recompile and no KV block left behind."""

from __future__ import annotations

import pytest
from test_structured_outputs_e2e import tiny_llm

from runtime import SamplingParams

ON = dict(num_scheduler_steps=4, enable_prefix_caching=True,
          speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                              "prompt_lookup_min": 1})
OFF = dict(num_scheduler_steps=1, enable_prefix_caching=False)


@pytest.mark.slow
def test_every_feature_on_gives_the_same_tokens():
    # A shared, repetitive prefix longer than a KV block (32 tokens): cache hits and n-gram drafts.
    shared = [40 + i % 7 for i in range(36)]
    prompts = [shared + [3], shared + [5, 6], shared * 2, list(range(60, 75)), [9, 8, 7] * 5, shared + [11]]
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2, trace=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=25, ignore_eos=True, repetition_penalty=1.2,
                       presence_penalty=0.3),
        SamplingParams(temperature=1.0, seed=4, top_k=20, max_tokens=20, ignore_eos=True, n=2),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": "[a-c]{3,8}"}),
        SamplingParams(temperature=0.6, seed=5, top_p=0.9, max_tokens=35, ignore_eos=True, min_tokens=5),
        SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, stop_token_ids=[44]),
    ]
    results = {}
    for name, args in (("on", ON), ("off", OFF)):
        llm = tiny_llm(**args)
        outs = llm.generate(prompts, params)
        results[name] = [(c.token_ids, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]
        st = llm.engine.stats()
        assert st.num_recompiles == 0
        assert llm.engine.block_manager.num_used == 0
        if name == "on":
            assert st.spec_num_drafts > 0 and st.prefix_cache_hits > 0
            assert outs[0].trace is not None and outs[0].trace["steps"]
    assert results["on"] == results["off"]
