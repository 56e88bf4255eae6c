"""One owner for request checks: SamplingParams checks value ranges, the engine checks what depends
on the model; both raise RequestError(message, param, code), which the server maps 1:1."""

from __future__ import annotations

import pytest

from models.config import get_preset
from models.weights import random_weights
from runtime import SamplingParams
from runtime.engine.plan import compile_plan
from config.engine_config import EngineConfig
from runtime.entrypoints.llm import LLM
from runtime.core.sampling_params import RequestError


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=2.5), "temperature"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2 ** 31), "top_k"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2, min_tokens=3), "min_tokens"), (dict(logprobs=21), "logprobs"),
    (dict(logit_bias={5: 101.0}), "logit_bias"), (dict(stop=[""]), "stop"), (dict(stop=["x"] * 17), "stop"),
    (dict(seed=2 ** 64), "seed"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_sampling_params_ranges(kw, param):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param and e.value.code == "invalid_value" and isinstance(e.value, ValueError)


@pytest.mark.slow
def test_engine_checks_what_depends_on_the_model():
    cfg = get_preset("tiny")
    llm = LLM.from_plan(compile_plan(None, EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                                                        num_kv_blocks=16),
                                     weights=random_weights(cfg, seed=0), config=cfg))
    cases = [([], SamplingParams(), "prompt", "empty_prompt"),
             ([1, 999], SamplingParams(), "prompt", "invalid_token_id"),
             ([1] * 60, SamplingParams(max_tokens=10), "prompt", "context_length_exceeded"),
             ([1, 2], SamplingParams(n=5), "n", "invalid_value"),
             ([1, 2], SamplingParams(logit_bias={300: 1.0}), "logit_bias", "invalid_value"),
             ([1, 2], SamplingParams(stop_token_ids=[256]), "stop_token_ids", "invalid_value")]
    for ids, params, param, code in cases:
        with pytest.raises(RequestError) as e:
            llm.engine.validate(ids, params)
        assert (e.value.param, e.value.code) == (param, code), e.value.message
    assert "out of vocabulary" in str(pytest.raises(RequestError, llm.engine.validate, [999], SamplingParams()).value)
