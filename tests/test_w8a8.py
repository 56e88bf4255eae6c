"""`quantization=w8a8`: int8 weights, and each step's activations quantized per row to int8 at run
time (matmul_int8 with `activations="i8"`). The op against an integer reference at ragged shapes
(the zero-row padding below W8A8_MIN_ROWS included), what the pass rewrites (the tied head too),
the weights it materializes, the engine with it, and accuracy on SmolLM2 against the golden fp32
continuations."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (first_divergence, golden_free_running, golden_llm, golden_teacher_forced, one_step_logits,
                      tiny_llm)
from ir import OPS, print_graph
from ir.int8 import INT8_ACTIVATIONS, W8A8_MIN_ROWS
from models.config import get_preset
from models.llama import lower
from passes.pipeline import PipelineOptions, run_pipeline
from runtime import SamplingParams
from runtime.worker.params import materialize, quantize_int8_weight
from tolerances import SAME_MATH_F32

matmul_int8 = OPS["matmul_int8"].impl


def graph_for(cfg, quantization="w8a8", dtype="f32", tp=1, precision="float32"):
    opts = PipelineOptions(max_model_len=128, buckets=((16, 4),), num_kv_blocks=32, quantization=quantization,
                           matmul_precision=precision, tensor_parallel_size=tp)
    return run_pipeline(lower(cfg, dtype), opts)


def _integer_reference(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per-row symmetric int8 of x, an exact integer product, both scales; in f64."""
    amax = np.abs(x).max(axis=-1, keepdims=True).astype(np.float64)
    row_scale = np.where(amax > 0, np.float32(amax / 127.0), 1.0)  # the op's f32 scale
    xq = np.clip(np.rint(x / row_scale.astype(np.float32)), -127, 127).astype(np.int64)
    return (xq @ q.astype(np.int64)) * row_scale * scale.astype(np.float64)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64])
@pytest.mark.parametrize("k,n", [(64, 96), (576, 960), (33, 7)])
def test_op_against_integer_reference(rows, k, n):
    """Every row count, below W8A8_MIN_ROWS (padded) and above: the per-row quantization and the
    int32 product are exact, so the op equals the integer reference to f32 rounding; an all-zero
    row stays zero. Against the f32 product of the unquantized weight, it is within int8 rounding."""
    rng = np.random.default_rng(rows * 1000 + k + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    zero = rows // 2 if rows > 1 else None
    if zero is not None:
        x[zero] = 0.0
    w = (rng.standard_normal((k, n)) / math.sqrt(k)).astype(np.float32)
    q, scale = quantize_int8_weight(w)
    got = np.asarray(matmul_int8(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), activations=INT8_ACTIVATIONS))
    assert got.shape == (rows, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, _integer_reference(x, q, scale), rtol=1e-5, atol=1e-5)
    assert zero is None or not got[zero].any()
    exact = x.astype(np.float64) @ w.astype(np.float64)
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert 0 < rel < 0.02, rel


def test_op_keeps_leading_axes_checks_its_attribute_and_weight_only_is_unchanged():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)  # 6 rows
    w = rng.standard_normal((8, 5)).astype(np.float32)
    q, scale = quantize_int8_weight(w)
    y = matmul_int8(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), activations=INT8_ACTIVATIONS)
    assert y.shape == (2, 3, 5)
    np.testing.assert_allclose(np.asarray(y).reshape(6, 5), _integer_reference(x.reshape(6, 8), q, scale),
                               rtol=1e-5, atol=1e-5)
    # Without the attribute: weight-only, the f32 activations times the widened weight.
    y_wo = np.asarray(matmul_int8(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale)))
    np.testing.assert_allclose(y_wo, (x @ q.astype(np.float32)) * scale, **SAME_MATH_F32)

    from ir import input_node, make_node
    from ir.ops import IRError

    xs, ws, ss = input_node("x", (4, 8), "f32"), input_node("w", (8, 5), "i8"), input_node("s", (5,), "f32")
    with pytest.raises(IRError, match="activations"):
        make_node("matmul_int8", (xs, ws, ss), {"activations": "i4"})
    assert make_node("matmul_int8", (xs, ws, ss), {"activations": "i8"}).shape == (4, 5)
    assert W8A8_MIN_ROWS >= 2


def test_pass_rewrites_every_matmul_and_the_tied_head():
    """Tied and untied: every matmul reads int8 weights with per-row int8 activations; the tied
    head reads an int8 copy of the transposed embedding, with the LM head's role, while the
    lookup keeps the f32 table. Weight-only int8 leaves the tied head alone (test_quantize)."""
    for tied in (False, True):
        cfg = get_preset("tiny").replace(tie_embeddings=tied)
        before, after = graph_for(cfg, None), graph_for(cfg)
        n_mm = sum(1 for n in before.nodes() if n.op == "matmul")
        assert n_mm == 4 * cfg.num_layers + 1
        ops = after.op_counts()
        assert ops["matmul_int8"] == n_mm and ops.get("matmul", 0) == 0 and ops["embedding"] == 1
        assert all(n.attr("activations") == "i8" for n in after.nodes() if n.op == "matmul_int8")
        head = after.output("logits")
        assert head.op == "matmul_int8"
        w, s = head.inputs[1], head.inputs[2]
        assert w.dtype == "i8" and w.shape == (cfg.hidden_size, cfg.vocab_size) and s.shape == (cfg.vocab_size,)
        assert w.attr("role") == "lm_head" and bool(w.attr("int8_transposed")) == tied
        assert next(p for p in after.params if p.name == "embed").dtype == "f32"
    # matmul_precision=bfloat16 finds no f32 matmul left to copy.
    assert "matmul_bf16" not in graph_for(get_preset("tiny"), precision="bfloat16").op_counts()


def test_materialized_weights_and_dump():
    """The tied head's int8 copy is quantized per vocab column of the transposed table; the IR text
    names the attribute and parses back to itself."""
    from ir import parse_graph
    from models.weights import random_weights

    cfg = get_preset("tiny").replace(tie_embeddings=True)
    g = graph_for(cfg)
    weights = random_weights(cfg, seed=3)
    vals = materialize(g, weights)
    q, scale = quantize_int8_weight(weights["embed"].T)
    np.testing.assert_array_equal(vals["embed.int8"], q)
    np.testing.assert_array_equal(vals["embed.scale"], scale)
    text = print_graph(g)
    assert 'activations="i8"' in text and "int8_transposed=true" in text
    assert print_graph(parse_graph(text)) == text


def test_with_tensor_parallel_on_one_device():
    """quantize (w8a8) then shard: the sharded graph computes what the unsharded one computes, and
    the head's int8 copy and its scale split by vocab column."""
    from models.weights import random_weights

    cfg = get_preset("tiny").replace(tie_embeddings=True)
    weights = random_weights(cfg, seed=3)
    logits = {}
    for tp in (1, 2):
        g = graph_for(cfg, tp=tp)
        if tp > 1:
            head = g.output("logits")
            assert head.inputs[1].attr("sharding") == (None, "tp")
            assert head.inputs[2].attr("sharding") == ("tp",)
        logits[tp] = one_step_logits(g, weights)
    np.testing.assert_allclose(logits[2], logits[1], **SAME_MATH_F32)


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.slow
def test_engine_runs_w8a8_close_to_f32():
    """The tiny model end to end, prefill chunks and one-row decode steps (padded): no recompiles,
    no leaked blocks; its chosen tokens' logprobs stay near the f32 engine's."""
    engine = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=64)
    f32, w8 = tiny_llm(**engine), tiny_llm(**engine, quantization="w8a8")
    assert w8.plan.graph.op_counts().get("matmul", 0) == 0
    prompts = [list(range(3, 3 + n)) for n in (4, 9, 17, 30, 2)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    a, b = _run(f32, prompts, params), _run(w8, prompts, params)
    assert [len(x[0]) for x in b] == [8] * len(prompts)
    first = sum(x[0][0] == y[0][0] for x, y in zip(a, b))
    assert first >= len(prompts) - 1, (a, b)  # the first token after each prompt, near-ties aside
    diffs = [abs(d[t] - e[t]) for x, y in zip(a, b) for d, e in zip(x[1], y[1]) for t in d if t in e]
    assert diffs and 0 < max(diffs) < 0.5
    assert w8.engine.stats().num_recompiles == 0
    w8.engine.block_manager.check_invariants([])
    assert w8.engine.block_manager.num_used == 0


# ----------------------------------------------------------------------------- SmolLM2 accuracy

@pytest.mark.slow
def test_smollm2_w8a8_accuracy(smollm2):
    """Against the golden fp32 continuations. Per-token int8 activations cost more than int8
    weights alone (125/128 teacher-forced, test_quantize) on this small model: measured 119/128
    on AVX2 machines and 115/128 on a Zen 5 with AVX-512 VNNI, last-position KL <= 0.09, and
    free-running greedy that follows fp32 for 4-22 tokens on AVX2 ([5, 1, 6, 11] on the Zen 5:
    one prompt's second token flips). The int8 products are exact on both
    (int32 accumulation); the f32 work around them (norms, attention, each row's scale) rounds
    differently with the vector width, and a row near a rounding edge takes another int8 code.
    The order of the f32 sums alone moves it as far: on a Xeon with AMX, 119/128 with prefill
    attention in XLA's query tiles and 112/128 with the C++ row kernel (2026-12-05), whose f32
    logits are as close to HF's (max 5e-5 at the last prompt position, both ways) and under which
    gguf_activations=q8 went from 124 to 127. So the bars sit below every machine and order
    measured: 0.86 teacher-forced, every first token the same, and half of the prompts following
    fp32 for 4 tokens or more; the KL bound holds the distribution."""
    llm = golden_llm(smollm2, quantization="w8a8")
    agree, total, kls = golden_teacher_forced(llm.engine.runner)
    print(f"\nw8a8 vs fp32 teacher-forced top-1 agreement: {agree}/{total} = {agree / total:.3f}; "
          f"last-position KL(fp32 || w8a8): " + ", ".join(f"{k} {v:.5f}" for k, v in kls.items()))
    assert agree / total >= 0.86
    assert all(np.isfinite(v) and 0 <= v < 0.2 for v in kls.values()), kls
    first_diff = [first_divergence(toks, gen) for toks, gen in golden_free_running(llm)]
    print(f"w8a8 free-running greedy: first divergence from fp32 at {first_diff}")
    assert min(first_diff) >= 1
    assert sorted(first_diff)[len(first_diff) // 2] >= 4, first_diff
    assert llm.engine.stats().num_recompiles == 0
