"""The executor's kernel backends agree: the tiny model through interpreted Pallas kernels, and
through our C++ decode kernel (cpp), == XLA."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from runtime import SamplingParams
from runtime.engine.plan import compile_plan
from config.engine_config import EngineConfig
from runtime.entrypoints.llm import LLM
from tolerances import BACKENDS_F32


def tiny_llm(backend: str) -> LLM:
    from models.config import ModelConfig
    from models.weights import random_weights

    # head_dim 16 (the kernels' minimum), GQA 4:2, two layers.
    cfg = ModelConfig(name="tiny-k", num_layers=2, hidden_size=64, intermediate_size=96, num_q_heads=4,
                      num_kv_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256)
    eng = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=48,
                       kernel_backend=backend)
    return LLM.from_plan(compile_plan(None, eng, weights=random_weights(cfg, seed=5), config=cfg))


def step_logits(llm: LLM, sched_steps):
    """Runs engine steps and returns the raw logits rows of each step (through the step hook)."""
    out = []
    llm.engine.step_hooks.append(
        lambda sched, outs: out.append(np.asarray(jax.device_get(outs["logits"]))[:sum(s.num_rows for s in sched.scheduled)]))
    for _ in range(sched_steps):
        llm.engine.step()
    return out


@pytest.mark.parametrize("other", ["interpret", "cpp"])
@pytest.mark.slow
def test_interpret_kernels_match_xla_end_to_end(other):
    xla, interp = tiny_llm("xla"), tiny_llm(other)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 33)]
    for llm in (xla, interp):
        for i, p in enumerate(prompts):
            llm.engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6))
    # Step 1 is a fresh prefill, then chunked prefill and decode, all through the paged kernel.
    a, b = step_logits(xla, 6), step_logits(interp, 6)
    # Hooks run as a step is dispatched: with async scheduling, step() has launched one more.
    assert len(a) == len(b) >= 6
    for x, y in zip(a, b):
        np.testing.assert_allclose(y, x, **BACKENDS_F32)


@pytest.mark.parametrize("other", ["interpret", "cpp"])
@pytest.mark.slow
def test_interpret_generation_matches_xla_with_prefix_hits(other):
    xla, interp = tiny_llm("xla"), tiny_llm(other)
    shared = list(range(10, 42))  # two full blocks, reused by the second request
    prompts = [shared + [50, 51], shared + [60, 61, 62]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    got = [[r.outputs[0].token_ids for r in llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)]
           for llm in (xla, interp)]
    assert got[0] == got[1]
    assert interp.engine.block_manager.stats.hits > 0
