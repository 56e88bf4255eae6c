"""The GPU path, checked on CPU: bf16 end to end, dtype auto, no KV-pool copies in the Pallas step,
the kernels lowering through Triton, and a plan that does not fit refused at start."""

from __future__ import annotations

import conftest
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ir import bind_shape
from models.config import get_preset
from runtime import SamplingParams
from runtime.core.buckets import BucketTable
from runtime.engine.plan import build_graph, compile_plan
from config.engine_config import EngineConfig, planning_for, resolve_dtype
from runtime.worker.executor import JNP_DTYPES, build_step, state_names
from runtime.worker.kernels import BF16_BITS, pool_storage_dtype
from runtime.entrypoints.llm import LLM

TINY = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)


def tiny_llm(**engine) -> LLM:
    return conftest.tiny_llm(seed=0, **(TINY | dict(num_kv_blocks=48) | engine))


# ---------------------------------------------------------------- bf16 and dtype auto


@pytest.mark.slow
def test_bf16_generates_through_llm_on_every_cpu_backend():
    """bf16 logits reach the sampler (and logprobs) as f32; xla and interpreted Pallas agree."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = {}
    for backend in ("xla", "interpret"):
        llm = tiny_llm(dtype="bfloat16", kernel_backend=backend)
        assert llm.plan.engine.dtype == "bf16"
        # On XLA:CPU the pools hold bf16 bits (runtime.worker.kernels.BF16_BITS).
        stored = BF16_BITS if backend == "xla" else jnp.bfloat16
        assert all(x.dtype == stored for x in llm.engine.runner.state.values())
        res = llm.generate([[1, 2, 3, 4], list(range(5, 40))], params)
        for r in res:
            assert len(r.outputs[0].token_ids) == 6
            assert all(np.isfinite(list(d.values())).all() for d in r.outputs[0].logprobs)
        outs[backend] = [r.outputs[0].token_ids for r in res]
        sampled = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.8, seed=3, max_tokens=4,
                                                         ignore_eos=True))
        assert len(sampled[0].outputs[0].token_ids) == 4
    assert outs["xla"] == outs["interpret"]


def test_dtype_auto_is_bf16_on_gpu_and_f32_on_cpu():
    assert resolve_dtype("auto", "gpu") == "bf16"
    assert resolve_dtype("auto", "cpu") == "f32"
    assert resolve_dtype("float32", "gpu") == "f32"
    assert EngineConfig().dtype == resolve_dtype("auto", jax.default_backend())
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float8")


# ---------------------------------------------------------------- the Pallas step and the pools


def _step_at(num_kv_blocks: int, backend: str, dtype: str = "f32"):
    cfg = get_preset("tiny")
    e = EngineConfig(**TINY, num_kv_blocks=num_kv_blocks, dtype=dtype)
    graph, _, _ = build_graph(cfg, e, BucketTable.build(32, 4), device_memory=1 << 30, keep_pass_texts=False)
    names = set(state_names(graph))
    env = {"T": 32, "S": 4, "R": 4, "M": math.ceil(128 / 16), "B": num_kv_blocks}
    spec = lambda leaf: jax.ShapeDtypeStruct(bind_shape(leaf.shape, env), JNP_DTYPES[leaf.dtype])  # noqa: E731
    params = {p.name: jax.ShapeDtypeStruct(p.shape, JNP_DTYPES[p.dtype]) for p in graph.params}
    # The pools in their storage dtype, as the model runner allocates them (bf16 bits on XLA:CPU).
    state = {x.name: jax.ShapeDtypeStruct(bind_shape(x.shape, env), pool_storage_dtype(JNP_DTYPES[x.dtype], backend))
             for x in graph.runtime_inputs if x.name in names}
    inputs = {x.name: spec(x) for x in graph.runtime_inputs if x.name not in names}
    step = jax.jit(build_step(graph, backend), donate_argnums=(1,))
    traced = step.trace(params, state, inputs)
    pool_bytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in state.values())
    return traced, pool_bytes, len(state)


# Not interpret-bf16: the interpreted Pallas kernels read the bf16 pools themselves, and on CPU
# XLA widens those (CPU emulation only; a GPU gathers bf16 natively).
@pytest.mark.parametrize("backend,dtype", [("interpret", "f32"), ("xla", "f32"), ("xla", "bf16")])
def test_step_temp_does_not_grow_with_the_pool_and_pools_alias(backend, dtype):
    """The KV pools reach every kernel as the donated buffers: no copy of a pool, in place. In
    bf16 too, where XLA:CPU would widen a bf16 pool to f32 for every gather and scatter."""
    temps = []
    for blocks in (64, 1024):
        traced, pool_bytes, _ = _step_at(blocks, backend, dtype)
        ma = traced.lower().compile().memory_analysis()
        temps.append(ma.temp_size_in_bytes)
        # Every pool byte of the outputs aliases a donated input.
        assert ma.alias_size_in_bytes >= pool_bytes
    # 16x the pool: the temporaries stay the same (a copy of one pool would add 2 MiB here).
    assert temps[1] == temps[0], temps


def test_pallas_step_lowers_for_cuda_through_triton():
    """On CPU we can't compile for a GPU, but we can lower: the paged kernels go to Triton
    custom calls (not Mosaic GPU), one per layer, and the pools are donated."""
    traced, _, num_pools = _step_at(64, "pallas")
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.custom_call @__gpu$xla.gpu.triton" in text
    # One call of the jitted kernel per layer (its body holds the Triton custom call).
    assert len(re.findall(r"call @paged_attention\b", text)) == get_preset("tiny").num_layers
    assert "mosaic" not in text.lower()
    donated = text.count("tf.aliasing_output") + text.count("jax.buffer_donor")
    assert donated >= num_pools


# ---------------------------------------------------------------- KV sizing and the fit check


def test_plan_budget_respects_the_allocator_limit():
    """memory_utilization is a fraction of the device; the allocator's limit caps it."""
    cfg = get_preset("tiny")
    free = EngineConfig(**TINY, device_memory=1 << 30)
    capped = EngineConfig(**TINY, device_memory=1 << 30, memory_limit=256 << 20)
    b = BucketTable.build(32, 4)
    with planning_for("gpu"):  # where the pool takes what the budget leaves (a CPU's holds what TINY uses)
        _, plan_free, _ = build_graph(cfg, free, b, keep_pass_texts=False)
        _, plan_capped, _ = build_graph(cfg, capped, b, keep_pass_texts=False)
    assert plan_capped.num_kv_blocks < plan_free.num_kv_blocks
    used = plan_capped.weight_bytes + plan_capped.peak_activation_bytes + plan_capped.reserve_bytes
    assert used + plan_capped.num_kv_blocks * plan_capped.kv_bytes_per_block <= 256 << 20


def test_engine_refuses_a_plan_that_does_not_fit():
    """More KV blocks than the device holds: a clear error with the numbers, before any pool exists."""
    with pytest.raises(MemoryError, match=r"does not fit.*KV cache.*MiB"):
        tiny_llm(num_kv_blocks=2_000_000, device_memory=64 << 20)


# ---------------------------------------------------------------- SmolLM2 in bf16


@pytest.mark.slow
def test_smollm2_bf16_through_llm_and_server(smollm2):
    """The real model in bf16 (what `auto` means on a GPU): teacher-forced on HF's f32 golden
    continuations, its top-1 equals HF's wherever HF's top-1/top-2 margin is wide enough for bf16
    rounding not to matter; and the HTTP server returns what LLM.generate does."""
    import httpx
    from conftest import golden_arrays, golden_prompts

    from runtime.serve import ServerThread, build_app

    config, weights, tok = smollm2
    engine = EngineConfig(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=96,
                          dtype="bfloat16")
    llm = LLM.from_plan(compile_plan(None, engine, weights=weights, config=config, tokenizer=tok),
                        check_invariants=True)
    assert llm.engine.runner.params["embed"].dtype == jnp.bfloat16
    checked = 0
    for p in golden_prompts():
        g = golden_arrays(p["name"])
        prompt, gen = g["prompt_ids"].tolist(), g["gen_ids"].tolist()
        out = llm.generate([prompt + gen], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
        for i, margin in enumerate(p["top1_top2_margin_per_step"]):
            if margin >= 1.0:
                lps = out.prompt_logprobs[len(prompt) + i]
                assert max(lps, key=lps.get) == gen[i], (p["name"], i)
                checked += 1
    assert checked >= 40

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    want = [r.outputs[0].text for r in llm.generate(prompts, params)]
    with ServerThread(build_app(llm.engine, served_model_names=["smol-bf16"], log_stats_interval=0)) as st:
        r = httpx.post(st.url + "/v1/completions", timeout=120, json={
            "model": "smol-bf16", "prompt": prompts, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == want
