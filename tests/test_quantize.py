"""int8 weight-only quantization: what the pass rewrites, the bytes the memory plan shows, and
accuracy on SmolLM2 against the fp32 engine over the golden prompts.

(tests/test_passes.py holds the pass's before/after text and its tiny-model numeric test.)
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from conftest import first_divergence, golden_free_running, golden_llm, golden_teacher_forced, one_step_logits
from ir import DTYPE_BYTES, print_graph
from models.config import get_preset
from models.llama import lower
from passes.pipeline import PipelineOptions, run_pipeline
from passes.plan_memory import weight_bytes
from tolerances import SAME_MATH_F32

def graph_for(cfg, quantization=None, dtype="f32", tp=1, lm_head=None):
    opts = PipelineOptions(max_model_len=128, buckets=((16, 4),), num_kv_blocks=32,
                           quantization=quantization, tensor_parallel_size=tp, quantize_lm_head=lm_head)
    return run_pipeline(lower(cfg, dtype), opts)


def test_every_constant_matmul_becomes_matmul_int8():
    """Untied: every matmul (q/k/v, o, gate/up, down, LM head). Tied: the LM head reads the
    embedding table, which the lookup needs whole, so it stays; the lookup is never rewritten."""
    for tied in (False, True):
        cfg = get_preset("tiny").replace(tie_embeddings=tied)
        before, after = graph_for(cfg), graph_for(cfg, "int8")
        n_mm = sum(1 for n in before.nodes() if n.op == "matmul" and not n.attr("transpose_b"))
        assert n_mm == 4 * cfg.num_layers + (0 if tied else 1)
        ops = after.op_counts()
        assert ops["matmul_int8"] == n_mm
        assert ops.get("matmul", 0) == (1 if tied else 0)
        assert ops["embedding"] == 1
        assert after.output("logits").op == ("matmul" if tied else "matmul_int8")
        for n in after.nodes():
            if n.op == "matmul_int8":
                w, s = n.inputs[1], n.inputs[2]
                assert w.dtype == "i8" and s.dtype == "f32" and s.shape == (w.shape[1],)
        emb = next(p for p in after.params if p.name == "embed")
        assert emb.dtype == "f32"


def test_quantize_lm_head_forces_the_head_either_way():
    """quantize_lm_head=True: the head reads int8 weights in both modes, a tied one from an int8 copy
    of the transposed embedding (weight-only: no activations attr); False: the head stays an f32
    matmul in both modes. The layers' matmuls are int8 either way."""
    for tied in (False, True):
        cfg = get_preset("tiny").replace(tie_embeddings=tied)
        for quant in ("int8", "w8a8"):
            on, off = graph_for(cfg, quant, lm_head=True), graph_for(cfg, quant, lm_head=False)
            head = on.output("logits")
            assert head.op == "matmul_int8" and on.op_counts()["matmul_int8"] == 4 * cfg.num_layers + 1
            w = head.inputs[1]
            assert w.dtype == "i8" and w.shape == (cfg.hidden_size, cfg.vocab_size) and w.attr("role") == "lm_head"
            assert bool(w.attr("int8_transposed")) == tied and (head.attr("activations") == "i8") == (quant == "w8a8")
            head = off.output("logits")
            assert head.op == "matmul" and head.inputs[1].dtype == "f32"
            assert off.op_counts()["matmul_int8"] == 4 * cfg.num_layers


@pytest.mark.slow
def test_an_int8_tied_head_under_weight_only_int8_computes_the_quantized_product():
    """Weight-only int8 with the tied head in int8: the logits are the f32 engine's within int8's
    rounding, and they differ from the default's (f32 head), so the int8 head is what ran."""
    from models.weights import random_weights

    cfg = get_preset("tiny").replace(tie_embeddings=True)
    weights = random_weights(cfg, seed=5)
    f32, default, head = (one_step_logits(graph_for(cfg, q, lm_head=h), weights)
                          for q, h in ((None, None), ("int8", None), ("int8", True)))
    assert np.abs(head - default).max() > 1e-4
    scale = np.abs(f32).max()
    assert np.abs(head - f32).max() < 0.01 * scale and np.abs(default - f32).max() < 0.01 * scale


def test_quantize_lm_head_needs_a_quantization():
    from config.flags import add_engine_args, engine_config_from_args
    from config.engine_config import EngineConfig

    with pytest.raises(ValueError, match="quantize_lm_head needs a quantization"):
        EngineConfig(quantize_lm_head=True)
    assert EngineConfig(quantize_lm_head=False).quantize_lm_head is False  # nothing to keep: allowed
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    cfg = engine_config_from_args(ap.parse_args(["--quantization", "int8", "--quantize-lm-head", "true"]))
    assert cfg.quantization == "int8" and cfg.quantize_lm_head is True
    assert engine_config_from_args(ap.parse_args([])).quantize_lm_head is None


def test_dump_shows_the_rewrite():
    text = print_graph(graph_for(get_preset("tiny"), "int8"))
    assert ("param %layers.0.wqkv.int8 : i8[64, 128] {concat=[\"layers.0.wq\", \"layers.0.wk\", "
            "\"layers.0.wv\"], quantize_int8=\"layers.0.wqkv\"}") in text
    assert "param %layers.0.wqkv.scale : f32[128] {" in text
    assert "= matmul_int8(%" in text and "%layers.0.w_down.int8, %layers.0.w_down.scale)" in text


def test_weight_bytes_halve_bf16_and_quarter_f32():
    """Each quantized weight: 1 byte per element against 2 (bf16) or 4 (f32), plus one f32 scale
    per output column. The memory plan's weight total shows it (embedding and norms stay)."""
    cfg = get_preset("tiny")
    f32, q = graph_for(cfg), graph_for(cfg, "int8")
    src = {p.name: p for p in f32.params}
    for p in q.params:
        if p.attr("quantize_int8"):
            w = src[p.attr("quantize_int8")]
            assert math.prod(p.shape) * DTYPE_BYTES["i8"] * 4 == math.prod(w.shape) * DTYPE_BYTES["f32"]
    mm = sum(math.prod(p.shape) for p in q.params if p.attr("quantize_int8"))
    scales = sum(4 * p.shape[0] for p in q.params if p.attr("int8_scale"))
    assert weight_bytes(q) == weight_bytes(f32) - 3 * mm + scales

    # A real model, as `runtime.tools.compile --dry-run` plans it: llama-2-7b (32 layers, untied).
    from runtime.core.buckets import BucketTable
    from runtime.engine.plan import build_graph
    from config.engine_config import EngineConfig

    cfg = get_preset("llama-2-7b")
    plans = {}
    for dtype, quant in (("f32", None), ("bf16", None), ("f32", "int8"), ("bf16", "int8")):
        engine = EngineConfig(dtype=dtype, quantization=quant, device_memory=80 << 30)
        buckets = BucketTable.build(engine.max_num_batched_tokens, engine.max_num_seqs)
        plans[dtype, quant] = build_graph(cfg, engine, buckets, keep_pass_texts=False)[1]
    gib = {k: m.weight_bytes / 2**30 for k, m in plans.items()}
    print("llama-2-7b weights GiB:", {f"{d}/{q or 'none'}": round(v, 2) for (d, q), v in gib.items()})
    assert 0.5 < gib["bf16", "int8"] / gib["bf16", None] < 0.52  # halves (the bf16 embedding stays)
    assert 0.25 < gib["f32", "int8"] / gib["f32", None] < 0.27  # quarters (the f32 embedding stays)
    # More KV blocks fit in the bytes the weights gave back.
    assert plans["bf16", "int8"].num_kv_blocks > plans["bf16", None].num_kv_blocks


@pytest.mark.slow
def test_int8_with_tensor_parallel_on_one_device():
    """quantize_int8 then shard: int8 weights and their scales take the same column layouts,
    and the sharded graph computes what the unsharded int8 graph computes."""
    from models.weights import random_weights

    cfg = get_preset("tiny")
    weights = random_weights(cfg, seed=3)
    logits = {}
    for tp in (1, 2, 4):
        g = graph_for(cfg, "int8", tp=tp)
        if tp > 1:
            text = print_graph(g)
            assert 'param %layers.0.wqkv.scale : f32[' in text and '"shards": ' + str(tp) in text
            assert 'param %layers.0.w_down.scale : f32[64] {int8_scale="layers.0.w_down", sharding=[null]}' in text
        logits[tp] = one_step_logits(g, weights)
    for tp in (2, 4):
        np.testing.assert_allclose(logits[tp], logits[1], **SAME_MATH_F32)


# ----------------------------------------------------------------------------- SmolLM2 accuracy

@pytest.mark.parametrize("lm_head", [None, True], ids=["f32_head", "int8_head"])
def test_smollm2_int8_accuracy(smollm2, lm_head):
    """Against the fp32 engine, whose greedy tokens and last-position logits are the golden ones
    (test_engine checks tokens exactly and logits to 1e-3). Teacher-forced: the int8 model reads
    the fp32 greedy continuation and must pick the same next token at >= 90% of the positions.
    KL(fp32 || int8) of each prompt's last-position distribution is reported and must be small.
    With the tied LM head in int8 too (quantize_lm_head) the same bars hold."""
    llm = golden_llm(smollm2, quantization="int8", quantize_lm_head=lm_head)
    agree, total, kls = golden_teacher_forced(llm.engine.runner)
    rate = agree / total
    print(f"\nint8 vs fp32 teacher-forced top-1 agreement: {agree}/{total} = {rate:.3f}; "
          f"last-position KL(fp32 || int8): " + ", ".join(f"{k} {v:.5f}" for k, v in kls.items()))
    assert rate >= 0.9
    assert all(np.isfinite(v) and 0 <= v < 0.1 for v in kls.values()), kls

    # Free-running greedy through the engine (the served path): report how far it follows fp32.
    runs = golden_free_running(llm)
    same = sum(a == b for toks, gen in runs for a, b in zip(toks, gen))
    first_diff = [first_divergence(toks, gen) for toks, gen in runs]
    print(f"int8 free-running greedy: {same}/{total} positions equal to fp32; first divergence at "
          f"{first_diff}")
    assert llm.engine.stats().num_recompiles == 0
    assert min(first_diff) >= 1  # the first token after every prompt agrees


@pytest.mark.parametrize("scanned", [True, False])
def test_weight_only_products_widen_one_layer_at_a_time_when_scanned(scanned):
    """XLA's weight-only product widens the int8 weights to the activations' dtype. Unrolled, those
    widenings depend on the weights alone, and XLA:CPU runs them all up front: SmolLM2's 512-token
    prefill held every layer's f32 copy at once (410 MiB of temps against an 85 MiB plan), and
    `--quantization int8` failed its memory check at start-up. Scanned over layers (the CPU default
    under weight-only int8, EngineConfig.scans_layers), one layer's are live at a time. The
    unrolled case is here to show the test can tell the two apart."""
    import jax
    import jax.numpy as jnp

    from ir.int8 import weight_only_matmul

    layers, k = 12, 256
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.integers(-127, 128, (layers, k, k), dtype=np.int8))
    scales = jnp.full((layers, k), 1e-2, jnp.float32)

    def step(x, ws, scales):
        if scanned:
            return jax.lax.scan(lambda x, ws: (jnp.tanh(weight_only_matmul(x, *ws)), None), x, (ws, scales))[0]
        for i in range(layers):
            x = jnp.tanh(weight_only_matmul(x, ws[i], scales[i]))
        return x

    x = jnp.ones((512, k), jnp.float32)
    temp = jax.jit(step).lower(x, ws, scales).compile().memory_analysis().temp_size_in_bytes
    widened = k * k * 4  # one layer's f32 weights
    assert (temp <= 3 * widened + 4 * x.size * 4) is scanned, (temp, widened)
