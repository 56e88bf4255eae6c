"""`matmul_precision=bfloat16`: the matmul_bf16 op against an f32 reference at several shapes, what
the bf16_matmuls pass rewrites and the bytes the memory plan shows, the engine with it (unrolled,
scanned, tensor-parallel), and accuracy on SmolLM2 against the golden fp32 continuations."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (first_divergence, golden_free_running, golden_llm, golden_teacher_forced, one_step_logits,
                      tiny_llm)
from ir import OPS, print_graph
from models.config import get_preset
from models.llama import lower
from passes.bf16_matmuls import BF16_MIN_ROWS
from passes.pipeline import PipelineOptions, run_pipeline
from passes.plan_memory import weight_bytes
from runtime import SamplingParams
from tolerances import BF16_MATMUL, BITWISE, SAME_MATH_F32

matmul, matmul_bf16 = OPS["matmul"].impl, OPS["matmul_bf16"].impl


def graph_for(cfg, precision="float32", dtype="f32", quantization=None, tp=1):
    opts = PipelineOptions(max_model_len=128, buckets=((16, 4),), num_kv_blocks=32, quantization=quantization,
                           matmul_precision=precision, tensor_parallel_size=tp)
    return run_pipeline(lower(cfg, dtype), opts)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64, 130])
@pytest.mark.parametrize("k,n", [(64, 96), (576, 960), (33, 7)])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_op_against_f32_reference(rows, k, n, transpose_b):
    """Below min_rows: exactly the f32 matmul. From min_rows: the bf16 product of bf16-rounded
    inputs, f32 accumulated; within bf16 rounding of the f32 product, on ragged shapes too."""
    rng = np.random.default_rng(rows * 1000 + k + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = (rng.standard_normal((n, k) if transpose_b else (k, n)) / math.sqrt(k)).astype(np.float32)
    wb = jnp.asarray(w.T if transpose_b else w, jnp.bfloat16)
    got = np.asarray(matmul_bf16(jnp.asarray(x), jnp.asarray(w), wb, min_rows=BF16_MIN_ROWS, transpose_b=transpose_b))
    ref = np.asarray(matmul(jnp.asarray(x), jnp.asarray(w), transpose_b=transpose_b))
    if rows < BF16_MIN_ROWS:
        np.testing.assert_allclose(got, ref, **BITWISE)
        return
    # The path taken is the bf16 one: equal to the product of the rounded inputs in f64...
    xr = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    exact = xr @ np.asarray(wb.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4)
    # ...and within bf16 rounding of the f32 product, and not equal to it.
    np.testing.assert_allclose(got, ref, **BF16_MATMUL)
    assert not np.array_equal(got, ref)


def test_op_keeps_leading_axes_and_checks_its_inputs():
    x = jnp.ones((2, 3, 8), jnp.float32)  # 6 rows: the bf16 path
    w = jnp.full((8, 5), 0.5, jnp.float32)
    y = matmul_bf16(x, w, w.astype(jnp.bfloat16), min_rows=4)
    assert y.shape == (2, 3, 5) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), 4.0, **BITWISE)

    from ir import input_node, make_node
    from ir.ops import IRError

    xs, ws = input_node("x", (4, 8), "f32"), input_node("w", (8, 5), "f32")
    with pytest.raises(IRError, match="must be bf16"):
        make_node("matmul_bf16", (xs, ws, input_node("wb", (8, 5), "f32")), {"min_rows": 4})
    with pytest.raises(IRError, match="columns"):
        make_node("matmul_bf16", (xs, ws, input_node("wb", (8, 6), "bf16")), {"min_rows": 4})
    with pytest.raises(IRError, match="min_rows"):
        make_node("matmul_bf16", (xs, ws, input_node("wb", (8, 5), "bf16")))


def test_pass_rewrites_every_f32_matmul_and_adds_half_the_bytes():
    """Tied and untied: every matmul (q/k/v, o, gate/up, down, LM head) reads a bf16 [in, out] copy
    of its weight; a tied head's copy is the transposed embedding, with the LM head's role. The
    memory plan's weights grow by half of the matmul weights' f32 bytes."""
    for tied in (False, True):
        cfg = get_preset("tiny").replace(tie_embeddings=tied)
        before, after = graph_for(cfg), graph_for(cfg, "bfloat16")
        n_mm = sum(1 for n in before.nodes() if n.op == "matmul")
        assert n_mm == 4 * cfg.num_layers + 1
        ops = after.op_counts()
        assert ops["matmul_bf16"] == n_mm and ops.get("matmul", 0) == 0 and ops["embedding"] == 1
        head = after.output("logits")
        assert head.op == "matmul_bf16"
        copy = head.inputs[2]
        assert copy.dtype == "bf16" and copy.attr("role") == "lm_head"
        assert copy.shape == (cfg.hidden_size, cfg.vocab_size)
        assert bool(copy.attr("bf16_transposed")) == tied
        copies = [p for p in after.params if p.attr("bf16_copy")]
        assert len(copies) == n_mm
        src = {p.name: p for p in before.params}
        extra = sum(math.prod(p.shape) * 2 for p in copies)
        assert extra * 2 == sum(math.prod(src[p.attr("bf16_copy")].shape) * 4 for p in copies)
        assert weight_bytes(after) == weight_bytes(before) + extra
    text = print_graph(after)
    assert 'param %layers.0.wqkv.bf16 : bf16[64, 128] {bf16_copy="layers.0.wqkv", concat=[' in text
    assert f"min_rows={BF16_MIN_ROWS}" in text


def test_ir_dump_shows_the_pass(capsys):
    """`python -m ir.dump --matmul-precision bfloat16 --after bf16_matmuls`: the copies next to their
    sources, and the IR text parses back to itself."""
    from ir import dump, parse_graph

    assert dump.main(["--model", "tiny", "--after", "bf16_matmuls", "--matmul-precision", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("IR after bf16_matmuls:\n")
    body = out.split("\n", 1)[1]
    assert print_graph(parse_graph(body)) == body
    lines = body.splitlines()
    src = next(i for i, line in enumerate(lines) if line.startswith("param %layers.0.w_down :"))
    assert lines[src + 1].startswith("param %layers.0.w_down.bf16 : bf16[")
    assert "= matmul_bf16(%" in body and "= matmul(" not in body


def test_pass_leaves_bf16_plans_and_int8_weights_alone():
    cfg = get_preset("tiny").replace(tie_embeddings=True)
    bf16 = graph_for(cfg, "bfloat16", dtype="bf16")
    assert "matmul_bf16" not in bf16.op_counts()
    q = graph_for(cfg, "bfloat16", quantization="int8")
    ops = q.op_counts()
    assert ops["matmul_int8"] == 4 * cfg.num_layers and ops["matmul_bf16"] == 1  # only the tied head


@pytest.mark.parametrize("tied", [False, True])
def test_with_tensor_parallel_on_one_device(tied):
    """bf16_matmuls then shard: each bf16 copy takes its source's split and column layout (the tied
    head's copy splits by vocab column, as an LM head), and the sharded graph computes what the
    unsharded bf16 graph computes."""
    from models.weights import random_weights

    cfg = get_preset("tiny").replace(tie_embeddings=tied)
    weights = random_weights(cfg, seed=3)
    logits = {}
    for tp in (1, 2, 4):
        g = graph_for(cfg, "bfloat16", tp=tp)
        if tp > 1:
            copies = {p.name: p for p in g.params if p.attr("bf16_copy")}
            src = {p.name: p for p in g.params}
            for p in copies.values():
                if not p.attr("bf16_transposed"):
                    assert p.attr("sharding") == src[p.attr("bf16_copy")].attr("sharding"), p.name
                    assert p.attr("tp_layout") == src[p.attr("bf16_copy")].attr("tp_layout"), p.name
            assert g.output("logits").inputs[2].attr("sharding") == (None, "tp")
        logits[tp] = one_step_logits(g, weights)
    for tp in (2, 4):
        # The same bf16 products, summed in another order across the split: f32 rounding only.
        np.testing.assert_allclose(logits[tp], logits[1], **SAME_MATH_F32)


def _run(llm, prompts, params):
    return [(c.token_ids, c.logprobs) for o in llm.generate(prompts, params) for c in o.outputs]


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_engine_follows_f32(scan):
    """The tiny model end to end: prefill chunks (>= 4 rows) take the bf16 path, one-row decode
    steps the f32 one. Greedy tokens equal the f32 engine's; chosen logprobs within bf16 rounding."""
    engine = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=64, scan_layers=scan)
    f32, bf16 = tiny_llm(**engine), tiny_llm(**engine, matmul_precision="bfloat16")
    assert "matmul_bf16" in bf16.plan.graph.op_counts()
    prompts = [list(range(3, 3 + n)) for n in (4, 9, 17, 30, 2)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    a, b = _run(f32, prompts, params), _run(bf16, prompts, params)
    assert [x[0] for x in a] == [x[0] for x in b]
    diffs = [abs(d[t] - e[t]) for x, y in zip(a, b) for d, e in zip(x[1], y[1]) for t in d if t in e]
    assert diffs and max(diffs) < 0.05 and max(diffs) > 0  # bf16 moved them, a little
    assert bf16.engine.stats().num_recompiles == 0
    # The device holds each copy as the bf16 of its source, transposed for the tied head.
    params_on_device = bf16.engine.runner.params
    if not scan:
        src, copy = params_on_device["layers.0.w_down"], params_on_device["layers.0.w_down.bf16"]
        assert copy.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(copy), np.asarray(src.astype(jnp.bfloat16)))


# ----------------------------------------------------------------------------- SmolLM2 accuracy

@pytest.mark.slow
def test_smollm2_bf16_accuracy(smollm2):
    """Against the golden fp32 continuations. Teacher-forced in 32-token chunks (the bf16 path):
    the next-token choice agrees at >= 95% of the positions, and KL(fp32 || bf16) of each prompt's
    last-position distribution is small. Free-running greedy through the engine: the first token
    after every prompt agrees."""
    llm = golden_llm(smollm2, matmul_precision="bfloat16")
    agree, total, kls = golden_teacher_forced(llm.engine.runner)  # >= 4 rows: the head's bf16 path too
    print(f"\nbf16 matmuls vs fp32 teacher-forced top-1 agreement: {agree}/{total} = {agree / total:.3f}; "
          f"last-position KL(fp32 || bf16): " + ", ".join(f"{k} {v:.5f}" for k, v in kls.items()))
    assert agree / total >= 0.95
    assert all(np.isfinite(v) and 0 <= v < 0.005 for v in kls.values()), kls  # measured <= 0.0003

    first_diff = [first_divergence(toks, gen) for toks, gen in golden_free_running(llm)]
    print(f"bf16 matmuls free-running greedy: first divergence from fp32 at {first_diff}")
    assert min(first_diff) >= 8 and sum(d == 32 for d in first_diff) >= 3  # measured: all 32, all 4
    assert llm.engine.stats().num_recompiles == 0
