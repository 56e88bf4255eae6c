"""`kv_cache_dtype="bfloat16"` (vLLM's --kv-cache-dtype): an f32 model's K/V stored in bf16.

The pools are bf16 in the IR (insert_paged_kv), kv_write rounds the new K/V to them, and attention
reads them back into f32. On XLA:CPU the runner stores a bf16 pool as its uint16 bits
(runtime.worker.kernels.BF16_BITS), because XLA:CPU runs bf16 gathers and scatters on the whole
pool widened to f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import first_divergence, golden_free_running, golden_llm, golden_teacher_forced, tiny_llm
from ir import OPS, parse_graph, print_graph
from models.config import get_preset
from models.llama import lower
from passes.pipeline import PipelineOptions, memory_report, run_pipeline
from runtime import SamplingParams
from config.engine_config import EngineConfig
from runtime.worker.kernels import BF16_BITS, kv_write_xla, paged_attention_xla, pool_storage_dtype
from tolerances import BITWISE, SAME_MATH_F32

kv_write_reference, paged_attention_reference = OPS["kv_write"].impl, OPS["paged_attention"].impl


def pools_of(graph):
    return [x for x in graph.runtime_inputs if "_pool." in x.name]


def options(kv_dtype=None, tp=1):
    return PipelineOptions(max_model_len=128, buckets=((16, 4),), device_memory_bytes=4 << 20,
                           kv_dtype=kv_dtype, tensor_parallel_size=tp)


def graph_for(kv_dtype=None, dtype="f32", tp=1):
    return run_pipeline(lower(get_preset("tiny"), dtype), options(kv_dtype, tp))


def bits(x):
    return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.bfloat16), BF16_BITS)


# ----------------------------------------------------------------------------- configuration

def test_engine_config_names_and_checks_the_kv_dtype():
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig(dtype="float32").kv_dtype() == "f32"
    assert EngineConfig(dtype="bfloat16").kv_dtype() == "bf16"
    assert EngineConfig(dtype="float32", kv_cache_dtype="bfloat16").kv_dtype() == "bf16"
    for bad in ("fp8", "float16", "bf16", None):
        with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, bfloat16"):
            EngineConfig(kv_cache_dtype=bad)


def test_cli_flag_reaches_the_engine_config():
    from config.flags import ArgumentParser, add_engine_args, engine_config_from_args

    ap = ArgumentParser()
    add_engine_args(ap)
    assert engine_config_from_args(ap.parse_args([])).kv_cache_dtype == "auto"
    assert engine_config_from_args(ap.parse_args(["--kv-cache-dtype", "bfloat16"])).kv_dtype() == "bf16"
    with pytest.raises(SystemExit):
        ap.parse_args(["--kv-cache-dtype", "fp8"])


# ----------------------------------------------------------------------------- the IR

def test_pools_take_the_kv_dtype_and_the_plan_holds_twice_the_blocks():
    f32, bf16 = graph_for(), graph_for("bf16")
    assert {p.dtype for p in pools_of(f32)} == {"f32"}
    assert {p.dtype for p in pools_of(bf16)} == {"bf16"}
    writes = [n for n in bf16.nodes() if n.op == "kv_write"]
    assert writes and all(n.dtype == "bf16" and n.inputs[1].dtype == "f32" for n in writes)
    assert all(n.dtype == "f32" for n in bf16.nodes() if n.op == "paged_attention")
    # Same budget, half the bytes per block: about twice the blocks (the weights take their share first).
    plans = {"f32": memory_report(f32, options()), "bf16": memory_report(bf16, options("bf16"))}
    assert plans["bf16"].kv_bytes_per_block * 2 == plans["f32"].kv_bytes_per_block
    blocks = {k: p.num_kv_blocks for k, p in plans.items()}
    assert blocks["f32"] > 10 and 2 * blocks["f32"] <= blocks["bf16"] <= 2 * blocks["f32"] + 1, blocks
    # The plan's report names the KV dtype.
    for name, plan in plans.items():
        assert plan.kv_dtype == name
        assert f"KiB/token, {name})" in plan.table()
    # A bf16 model with a bf16 KV cache: the same graph as `auto`.
    assert print_graph(graph_for("bf16", dtype="bf16")) == print_graph(graph_for(None, dtype="bf16"))


def test_tensor_parallel_splits_bf16_pools_by_kv_head():
    g = graph_for("bf16", tp=2)
    assert {p.dtype for p in pools_of(g)} == {"bf16"}
    shardings = [p.attr("sharding") for p in pools_of(g)]
    assert all(x == (None, None, "tp", None) for x in shardings), shardings


def test_ir_dump_flag_and_text_round_trip(capsys):
    from ir import dump

    assert dump.main(["--model", "tiny", "--after", "insert_paged_kv", "--kv-cache-dtype", "bfloat16"]) == 0
    body = capsys.readouterr().out.split("\n", 1)[1]
    assert print_graph(parse_graph(body)) == body
    assert f"input %k_pool.0 : bf16[B, {EngineConfig().block_size}, " in body
    assert "= kv_write(%k_pool.0" in body


def test_kv_write_checks_its_inputs():
    from ir import IRError, input_node, make_node

    pool = input_node("p", ("B", 16, 2, 8), "bf16")
    ok = make_node("kv_write", (pool, input_node("k", ("T", 2, 8), "f32"), input_node("s", ("T",), "i32")))
    assert ok.dtype == "bf16"
    with pytest.raises(IRError, match="floating point pool"):
        make_node("kv_write", (pool, input_node("k", ("T", 2, 8), "i32"), input_node("s", ("T",), "i32")))


# ----------------------------------------------------------------------------- the ops

@pytest.mark.parametrize("blocks,bs,kvh,d,tokens", [(8, 16, 2, 16, 5), (33, 8, 3, 64, 40), (4, 16, 1, 128, 1)])
def test_kv_write_rounds_to_the_pool_and_the_bits_form_matches(blocks, bs, kvh, d, tokens):
    rng = np.random.default_rng(blocks)
    new = jnp.asarray(rng.standard_normal((tokens, kvh, d)), jnp.float32)
    slots = rng.choice(blocks * bs, tokens, replace=False).astype(np.int32)
    slots[::3] = -1  # padding tokens write nothing
    pool = jnp.asarray(rng.standard_normal((blocks, bs, kvh, d)), jnp.bfloat16)
    ref = kv_write_reference(pool, new, jnp.asarray(slots))
    as_f32 = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    flat, old = as_f32(ref).reshape(-1, kvh, d), as_f32(pool).reshape(-1, kvh, d)
    written = slots >= 0
    np.testing.assert_array_equal(flat[slots[written]], as_f32(new.astype(jnp.bfloat16))[written])
    untouched = np.setdiff1d(np.arange(blocks * bs), slots[written])
    np.testing.assert_array_equal(flat[untouched], old[untouched])
    # The XLA lowering on a pool of bf16 bits writes the same bits.
    out = kv_write_xla(bits(pool), new, jnp.asarray(slots))
    assert out.dtype == BF16_BITS
    np.testing.assert_array_equal(np.asarray(out), np.asarray(bits(ref)))


# (tokens per sequence this step, context after it): decode rows, ragged prefill chunks, prefix
# hits, lengths off block boundaries; plus the bucket (T, S).
ATTENTION_CASES = [
    ((16, 16), [1] * 11, [1, 7, 16, 17, 33, 50, 64, 65, 99, 120, 127]),
    ((64, 4), [30, 1, 13], [30, 45, 13]),
    ((64, 4), [17, 9], [83, 9]),
    ((128, 8), [5, 1, 40, 1, 60], [77, 128, 40, 3, 100]),
]


@pytest.mark.parametrize("bucket,q_lens,ctx", ATTENTION_CASES)
@pytest.mark.parametrize("row_kernel", [False, True], ids=["xla", "cpp"])
def test_xla_attention_over_bf16_bits_matches_the_reference(bucket, q_lens, ctx, row_kernel):
    """paged_attention_xla over pools stored as bf16 bits equals the jnp reference over the same
    pools in bf16 (both widen to f32 and compute in f32), including the new-K/V path of prefills;
    also with its per-row walks in our C++ kernel (kernel_backend="cpp"), which reads the bits."""
    (t, s), heads, kvh, d, bs, m = bucket, 6, 2, 32, 16, 8
    blocks = s * m + 3
    rng = np.random.default_rng(t + s)
    tables = rng.permutation(blocks)[: s * m].reshape(s, m).astype(np.int32)
    q_lens = q_lens + [0] * (s - len(q_lens))
    ctx = np.asarray(ctx + [0] * (s - len(ctx)), np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((t, heads, d)), jnp.float32)
    k_pool = jnp.asarray(rng.standard_normal((blocks, bs, kvh, d)), jnp.bfloat16)
    v_pool = jnp.asarray(rng.standard_normal((blocks, bs, kvh, d)), jnp.bfloat16)
    # This step's K/V, as written: read back from the pools at their slots (bf16 values in f32).
    tok = np.arange(t)
    seq = np.clip(np.searchsorted(cu, tok, side="right") - 1, 0, s - 1)
    pos = ctx[seq] - (cu[seq + 1] - cu[seq]) + (tok - cu[seq])
    live = tok < cu[-1]
    blk, off = tables[seq, np.clip(pos, 0, None) // bs], np.clip(pos, 0, None) % bs
    k_new = jnp.where(live[:, None, None], k_pool[blk, off].astype(jnp.float32), 0.0)
    v_new = jnp.where(live[:, None, None], v_pool[blk, off].astype(jnp.float32), 0.0)
    attrs = dict(scale=d ** -0.5, num_kv_heads=kvh, block_size=bs, head_dim=d)
    args = (jnp.asarray(tables), jnp.asarray(ctx), jnp.asarray(cu))
    ref = paged_attention_reference(q, k_pool, v_pool, *args, **attrs)
    xla = jax.jit(lambda *a: paged_attention_xla(*a, **attrs, k_new=k_new, v_new=v_new, row_kernel=row_kernel))
    got = xla(q, bits(k_pool), bits(v_pool), *args)
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(ref)[live], **SAME_MATH_F32)
    if row_kernel:
        return  # the kernel reads bf16 bits only; bf16 pools themselves are GPU's
    # The same lowering over the bf16 pools themselves (GPU's XLA path) computes the same.
    same = xla(q, k_pool, v_pool, *args)
    np.testing.assert_allclose(np.asarray(same), np.asarray(got), **BITWISE)


def test_storage_dtype_is_bits_only_for_bf16_under_xla_on_cpu():
    assert pool_storage_dtype(jnp.bfloat16, "xla") == BF16_BITS  # these tests run on CPU
    assert pool_storage_dtype(jnp.float32, "xla") == jnp.float32
    assert pool_storage_dtype(jnp.bfloat16, "cpp") == BF16_BITS
    assert pool_storage_dtype(jnp.bfloat16, "interpret") == jnp.bfloat16  # the Pallas kernels read bf16
    assert pool_storage_dtype(jnp.bfloat16, "pallas") == jnp.bfloat16


# ----------------------------------------------------------------------------- the engine

def _run(llm, prompts, params):
    return [(c.token_ids, c.logprobs) for o in llm.generate(prompts, params) for c in o.outputs]


@pytest.mark.parametrize("backend,scan", [("xla", False), ("xla", True), ("cpp", False), ("cpp", True),
                                          ("interpret", False)])
@pytest.mark.slow
def test_engine_follows_the_f32_cache(backend, scan):
    """The tiny model end to end (chunked prefill, decode, prefix hits): greedy tokens equal the f32
    cache's, chosen logprobs within bf16 rounding of K/V; the pools hold bf16 (as bits on XLA:CPU)."""
    engine = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=64,
                  scan_layers=scan, kernel_backend=backend)
    f32, bf16 = tiny_llm(**engine), tiny_llm(**engine, kv_cache_dtype="bfloat16")
    stored = BF16_BITS if backend in ("xla", "cpp") else jnp.bfloat16
    assert {x.dtype for x in bf16.engine.runner.state.values()} == {np.dtype(stored)}
    assert bf16.engine.runner.kv_cache_bytes() * 2 == f32.engine.runner.kv_cache_bytes()
    shared = list(range(3, 40))
    prompts = [list(range(3, 3 + n)) for n in (4, 9, 17, 30, 2)] + [shared + [50], shared + [60, 61]]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=1, ignore_eos=True)
    a, b = _run(f32, prompts, params), _run(bf16, prompts, params)
    assert [x[0] for x in a] == [x[0] for x in b]
    diffs = [abs(d[t] - e[t]) for x, y in zip(a, b) for d, e in zip(x[1], y[1]) for t in d if t in e]
    assert diffs and 0 < max(diffs) < 0.02  # bf16 K/V moved them, a little
    assert bf16.engine.stats().num_recompiles == 0
    assert bf16.engine.block_manager.num_used == 0


# ----------------------------------------------------------------------------- SmolLM2 accuracy

@pytest.mark.slow
def test_smollm2_bf16_kv_cache_accuracy(smollm2):
    """The real model with f32 weights and a bf16 KV cache, against the golden fp32 continuations:
    teacher-forced in 32-token chunks (each chunk reads the earlier ones from the bf16 pools), the
    next-token choice agrees at >= 97% of the positions; free-running greedy follows fp32."""
    llm = golden_llm(smollm2, kv_cache_dtype="bfloat16")
    runner = llm.engine.runner
    assert {x.dtype for x in runner.state.values()} == {np.dtype(BF16_BITS)}
    agree, total, kls = golden_teacher_forced(runner)
    print(f"\nbf16 KV vs fp32 teacher-forced top-1 agreement: {agree}/{total}; last-position KL: "
          + ", ".join(f"{k} {v:.6f}" for k, v in kls.items()))
    assert agree / total >= 0.97
    assert all(np.isfinite(v) and 0 <= v < 0.005 for v in kls.values()), kls  # measured <= 0.00003

    first_diff = [first_divergence(toks, gen) for toks, gen in golden_free_running(llm)]
    print(f"bf16 KV free-running greedy: first divergence from fp32 at {first_diff}")
    assert min(first_diff) >= 8 and sum(d == 32 for d in first_diff) >= 3  # measured: all 32, all 4
    assert llm.engine.stats().num_recompiles == 0
