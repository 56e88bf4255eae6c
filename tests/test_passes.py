"""Every pass, three ways (xDSL/MLIR style):

(a) before/after: input IR text -> parse -> pass -> compare with the expected IR text;
(b) numerics: the whole tiny model's logits do not change (int8: stay close);
(c) a pass that matches nothing returns its input object.

The numeric tests run a ragged three-step schedule on the tiny preset: a two-prompt prefill,
then a mixed step (a decode, a chunked prefill over a cached prefix, a new prompt, padding), then
a decode of all three. The textbook graph runs it on contiguous caches; the paged graphs on KV
pools whose block tables are a random permutation of the blocks.
"""

from __future__ import annotations

import functools
from functools import partial

import jax
import numpy as np
import pytest

from ir import Graph, VerifyError, parse_graph, print_graph, verify
from models.config import get_preset
from models.llama import lower
from models.weights import random_weights
from passes import pipeline as pipeline_mod
from passes.bf16_matmuls import bf16_matmuls
from passes.fuse_attention import fuse_attention
from passes.fuse_matmuls import fuse_matmuls
from passes.gguf_blocks import gguf_blocks
from passes.insert_paged_kv import insert_paged_kv
from passes.pipeline import PipelineOptions, build_pipeline, run_pipeline
from passes.plan_memory import plan_memory
from passes.quantize_int8 import quantize_int8
from runtime.worker.executor import JNP_DTYPES, jit_step, state_names, to_device_params
from runtime.worker.params import materialize
from tolerances import BITWISE, QUANT_SCALE, SAME_MATH_F32

F32_TOL = SAME_MATH_F32  # "logits unchanged" by a pass


def run_pass(text: str, fn) -> str:
    g = verify(parse_graph(text))
    assert print_graph(g) == text, "the input literal is not in printed form"
    return print_graph(verify(fn(g)))


# ============================================================================ (a) before / after

ATTENTION_TEXT = """\
input %q : f32[T, 4, 8]
input %k_cache.0 : f32[S, L, 2, 8]
input %v_cache.0 : f32[S, L, 2, 8]
input %seq_ids : i32[T]
input %positions : i32[T]
%0 = gather_rows(%k_cache.0, %seq_ids) : f32[T, L, 2, 8]
%1 = repeat_kv(%0) {n_rep=2} : f32[T, L, 4, 8]
%2 = einsum(%q, %1) {eq="thd,tlhd->thl"} : f32[T, 4, L]
%3 = scale(%2) {value=0.35355339059327373} : f32[T, 4, L]
%4 = causal_mask(%3, %positions) : f32[T, 4, L]
%5 = softmax(%4) : f32[T, 4, L]
%6 = gather_rows(%v_cache.0, %seq_ids) : f32[T, L, 2, 8]
%7 = repeat_kv(%6) {n_rep=2} : f32[T, L, 4, 8]
%8 = einsum(%5, %7) {eq="thl,tlhd->thd"} : f32[T, 4, 8]
output o = %8
"""


def test_fuse_attention_text():
    assert run_pass(ATTENTION_TEXT, fuse_attention) == """\
input %q : f32[T, 4, 8]
input %k_cache.0 : f32[S, L, 2, 8]
input %v_cache.0 : f32[S, L, 2, 8]
input %seq_ids : i32[T]
input %positions : i32[T]
%0 = attention(%q, %k_cache.0, %v_cache.0, %seq_ids, %positions) {causal=true, head_dim=8, num_kv_heads=2, scale=0.35355339059327373} : f32[T, 4, 8]
output o = %0
"""


def test_fuse_attention_text_without_gqa_broadcast():
    # One q head per kv head: no repeat_kv between the gather and the einsums.
    text = (ATTENTION_TEXT.replace("f32[T, 4, 8]", "f32[T, 2, 8]").replace("f32[T, 4, L]", "f32[T, 2, L]")
            .replace("%1 = repeat_kv(%0) {n_rep=2} : f32[T, L, 4, 8]\n", "")
            .replace("%7 = repeat_kv(%6) {n_rep=2} : f32[T, L, 4, 8]\n", ""))
    text = print_graph(parse_graph(text.replace("einsum(%q, %1)", "einsum(%q, %0)")
                                   .replace("einsum(%5, %7)", "einsum(%5, %6)")))
    out = run_pass(text, fuse_attention)
    assert "%0 = attention(%q, %k_cache.0, %v_cache.0, %seq_ids, %positions) {causal=true, head_dim=8, " \
           "num_kv_heads=2, scale=0.35355339059327373} : f32[T, 2, 8]" in out


def test_fuse_attention_text_carries_softcap_and_window():
    # Gemma 2: scale, then softcap, then a sliding-window causal mask.
    text = ATTENTION_TEXT.replace(
        "%4 = causal_mask(%3, %positions) : f32[T, 4, L]\n",
        "%4 = softcap(%3) {cap=50.0} : f32[T, 4, L]\n%5 = causal_mask(%4, %positions) {window=4096} : f32[T, 4, L]\n")
    text = text.replace("%5 = softmax(%4)", "%6 = softmax(%5)").replace("%6 = gather_rows(%v_cache.0", "%7 = gather_rows(%v_cache.0")
    text = text.replace("%7 = repeat_kv(%6)", "%8 = repeat_kv(%7)").replace("%8 = einsum(%5, %7)", "%9 = einsum(%6, %8)")
    text = text.replace("output o = %8", "output o = %9")
    assert run_pass(text, fuse_attention).splitlines()[5] == (
        "%0 = attention(%q, %k_cache.0, %v_cache.0, %seq_ids, %positions) {causal=true, head_dim=8, num_kv_heads=2, "
        "scale=0.35355339059327373, softcap=50.0, window=4096} : f32[T, 4, 8]")


def test_insert_paged_kv_text_carries_softcap_and_window():
    text = PAGED_INPUT_TEXT.replace("scale=0.35355339059327373}", "scale=0.35355339059327373, softcap=50.0, window=8}")
    out = run_pass(text, partial(insert_paged_kv, block_size=4))
    assert ("%2 = paged_attention(%q, %0, %1, %block_tables, %context_lens, %cu_q_lens) {block_size=4, head_dim=8, "
            "new_kv_written=true, num_kv_heads=2, scale=0.35355339059327373, softcap=50.0, window=8} : f32[T, 4, 8]") in out


def test_insert_paged_kv_puts_windowed_layers_beside_full_ones_in_the_window_group():
    """A windowed layer beside a full one: its pools take the window group's block count BW, and its
    kv_write and paged_attention the window group's slots and tables (ir.kv_groups). With windowed
    layers only, one full group stays (test above)."""
    text = PAGED_INPUT_TEXT.replace("output o = %2\n", """\
%3 = kv_cache_update(%k_cache.1, %k, %seq_ids, %positions) : f32[S, L, 2, 8]
%4 = kv_cache_update(%v_cache.1, %v, %seq_ids, %positions) : f32[S, L, 2, 8]
%5 = attention(%q, %3, %4, %seq_ids, %positions) {causal=true, head_dim=8, num_kv_heads=2, scale=0.35355339059327373, window=6} : f32[T, 4, 8]
output o = %2
output o1 = %5
output k_cache.1 = %3
output v_cache.1 = %4
""").replace("input %v_cache.0 : f32[S, L, 2, 8]\n", """\
input %v_cache.0 : f32[S, L, 2, 8]
input %k_cache.1 : f32[S, L, 2, 8]
input %v_cache.1 : f32[S, L, 2, 8]
""")
    out = run_pass(text, partial(insert_paged_kv, block_size=4))
    lines = out.splitlines()
    assert lines[:10] == [
        "input %slot_mapping : i32[T]",
        "input %block_tables : i32[S, M]",
        "input %window_slot_mapping : i32[T]",
        "input %window_block_tables : i32[S, M]",
        "input %context_lens : i32[S]",
        "input %cu_q_lens : i32[S+1]",
        "input %k_pool.0 : f32[B, 4, 2, 8]",
        "input %v_pool.0 : f32[B, 4, 2, 8]",
        "input %k_pool.1 : f32[BW, 4, 2, 8]",
        "input %v_pool.1 : f32[BW, 4, 2, 8]",
    ]
    assert "%3 = kv_write(%k_pool.1, %k, %window_slot_mapping) : f32[BW, 4, 2, 8]" in lines
    assert ("%5 = paged_attention(%q, %3, %4, %window_block_tables, %context_lens, %cu_q_lens) {block_size=4, "
            "head_dim=8, new_kv_written=true, num_kv_heads=2, scale=0.35355339059327373, window=6} : f32[T, 4, 8]") in lines
    assert "%2 = paged_attention(%q, %0, %1, %block_tables, %context_lens, %cu_q_lens)" in out
    from ir.kv_groups import kv_window

    assert kv_window(parse_graph(out)) == 6 and kv_window(parse_graph(run_pass(PAGED_INPUT_TEXT, insert_paged_kv))) is None


PAGED_INPUT_TEXT = """\
input %positions : i32[T]
input %seq_ids : i32[T]
input %q : f32[T, 4, 8]
input %k : f32[T, 2, 8]
input %v : f32[T, 2, 8]
input %k_cache.0 : f32[S, L, 2, 8]
input %v_cache.0 : f32[S, L, 2, 8]
%0 = kv_cache_update(%k_cache.0, %k, %seq_ids, %positions) : f32[S, L, 2, 8]
%1 = kv_cache_update(%v_cache.0, %v, %seq_ids, %positions) : f32[S, L, 2, 8]
%2 = attention(%q, %0, %1, %seq_ids, %positions) {causal=true, head_dim=8, num_kv_heads=2, scale=0.35355339059327373} : f32[T, 4, 8]
output o = %2
output k_cache.0 = %0
output v_cache.0 = %1
"""


def test_insert_paged_kv_text():
    # positions and seq_ids only fed the contiguous cache, so they drop out with it; the paged
    # inputs take their place.
    assert run_pass(PAGED_INPUT_TEXT, partial(insert_paged_kv, block_size=4)) == """\
input %slot_mapping : i32[T]
input %block_tables : i32[S, M]
input %context_lens : i32[S]
input %cu_q_lens : i32[S+1]
input %k_pool.0 : f32[B, 4, 2, 8]
input %v_pool.0 : f32[B, 4, 2, 8]
input %q : f32[T, 4, 8]
input %k : f32[T, 2, 8]
input %v : f32[T, 2, 8]
%0 = kv_write(%k_pool.0, %k, %slot_mapping) : f32[B, 4, 2, 8]
%1 = kv_write(%v_pool.0, %v, %slot_mapping) : f32[B, 4, 2, 8]
%2 = paged_attention(%q, %0, %1, %block_tables, %context_lens, %cu_q_lens) {block_size=4, head_dim=8, new_kv_written=true, num_kv_heads=2, scale=0.35355339059327373} : f32[T, 4, 8]
output o = %2
output k_pool.0 = %0
output v_pool.0 = %1
"""


def test_insert_paged_kv_text_keeps_positions_used_elsewhere():
    # As in the real model, positions also feed rope: it stays, and the paged inputs follow it.
    text = """\
input %positions : i32[T]
input %seq_ids : i32[T]
input %q : f32[T, 4, 8]
input %k : f32[T, 2, 8]
input %v : f32[T, 2, 8]
input %k_cache.0 : f32[S, L, 2, 8]
input %v_cache.0 : f32[S, L, 2, 8]
%0 = rope(%q, %positions) {theta=10000.0} : f32[T, 4, 8]
%1 = kv_cache_update(%k_cache.0, %k, %seq_ids, %positions) : f32[S, L, 2, 8]
%2 = kv_cache_update(%v_cache.0, %v, %seq_ids, %positions) : f32[S, L, 2, 8]
%3 = attention(%0, %1, %2, %seq_ids, %positions) {causal=true, head_dim=8, num_kv_heads=2, scale=0.35355339059327373} : f32[T, 4, 8]
output o = %3
output k_cache.0 = %1
output v_cache.0 = %2
"""
    assert run_pass(text, insert_paged_kv) == """\
input %positions : i32[T]
input %slot_mapping : i32[T]
input %block_tables : i32[S, M]
input %context_lens : i32[S]
input %cu_q_lens : i32[S+1]
input %k_pool.0 : f32[B, 16, 2, 8]
input %v_pool.0 : f32[B, 16, 2, 8]
input %q : f32[T, 4, 8]
input %k : f32[T, 2, 8]
input %v : f32[T, 2, 8]
%0 = rope(%q, %positions) {theta=10000.0} : f32[T, 4, 8]
%1 = kv_write(%k_pool.0, %k, %slot_mapping) : f32[B, 16, 2, 8]
%2 = kv_write(%v_pool.0, %v, %slot_mapping) : f32[B, 16, 2, 8]
%3 = paged_attention(%0, %1, %2, %block_tables, %context_lens, %cu_q_lens) {block_size=16, head_dim=8, new_kv_written=true, num_kv_heads=2, scale=0.35355339059327373} : f32[T, 4, 8]
output o = %3
output k_pool.0 = %1
output v_pool.0 = %2
"""


QKV_TEXT = """\
input %x : f32[T, 8]
param %layers.0.wq : f32[8, 8] role=q
param %layers.0.wk : f32[8, 4] role=k
param %layers.0.wv : f32[8, 4] role=v
param %layers.0.bq : f32[8] role=q_bias
param %layers.0.bk : f32[4] role=k_bias
param %layers.0.bv : f32[4] role=v_bias
%0 = matmul(%x, %layers.0.wq) : f32[T, 8]
%1 = add(%0, %layers.0.bq) : f32[T, 8]
%2 = matmul(%x, %layers.0.wk) : f32[T, 4]
%3 = add(%2, %layers.0.bk) : f32[T, 4]
%4 = matmul(%x, %layers.0.wv) : f32[T, 4]
%5 = add(%4, %layers.0.bv) : f32[T, 4]
output q = %1
output k = %3
output v = %5
"""


def test_fuse_matmuls_text_qkv_with_bias():
    assert run_pass(QKV_TEXT, fuse_matmuls) == """\
input %x : f32[T, 8]
param %layers.0.wqkv : f32[8, 16] {concat=["layers.0.wq", "layers.0.wk", "layers.0.wv"]} role=qkv
param %layers.0.bqkv : f32[16] {concat=["layers.0.bq", "layers.0.bk", "layers.0.bv"]} role=qkv_bias
%0 = matmul(%x, %layers.0.wqkv) : f32[T, 16]
%1 = add(%0, %layers.0.bqkv) : f32[T, 16]
%2 = slice(%1) {start=0, stop=8} : f32[T, 8]
%3 = slice(%1) {start=8, stop=12} : f32[T, 4]
%4 = slice(%1) {start=12, stop=16} : f32[T, 4]
output q = %2
output k = %3
output v = %4
"""


MLP_TEXT = """\
input %x : f32[T, 8]
param %w_gate : f32[8, 16] role=gate
param %w_up : f32[8, 16] role=up
param %w_down : f32[16, 8] role=down
%0 = matmul(%x, %w_gate) : f32[T, 16]
%1 = silu(%0) : f32[T, 16]
%2 = matmul(%x, %w_up) : f32[T, 16]
%3 = mul(%1, %2) : f32[T, 16]
%4 = matmul(%3, %w_down) : f32[T, 8]
output y = %4
"""


def test_fuse_matmuls_text_gate_up():
    assert run_pass(MLP_TEXT, fuse_matmuls) == """\
input %x : f32[T, 8]
param %w_gate_up : f32[8, 32] {concat=["w_gate", "w_up"]} role=gate_up
param %w_down : f32[16, 8] role=down
%0 = matmul(%x, %w_gate_up) : f32[T, 32]
%1 = slice(%0) {start=0, stop=16} : f32[T, 16]
%2 = silu(%1) : f32[T, 16]
%3 = slice(%0) {start=16, stop=32} : f32[T, 16]
%4 = mul(%2, %3) : f32[T, 16]
%5 = matmul(%4, %w_down) : f32[T, 8]
output y = %5
"""


def test_fuse_matmuls_keeps_weights_of_different_gguf_formats_apart():
    """A Q4_K_M file's attn_q/attn_k are Q4_K and its attn_v Q6_K: a fused weight could keep neither's
    blocks (it would stay f32), so a group of mixed formats stays unfused; one format fuses."""
    assert run_pass(MLP_TEXT, partial(fuse_matmuls, formats={"w_gate": "q4_k", "w_up": "q6_k"})) == MLP_TEXT
    same = run_pass(MLP_TEXT, partial(fuse_matmuls, formats={"w_gate": "q4_k", "w_up": "q4_k", "w_down": "q6_k"}))
    assert same == run_pass(MLP_TEXT, fuse_matmuls)


QUANT_TEXT = """\
input %x : f32[T, 8]
param %embed : f32[32, 8] role=embed
param %w_gate_up : f32[8, 32] {concat=["w_gate", "w_up"]} role=gate_up
param %w_down : f32[16, 8] role=down
%0 = matmul(%x, %w_gate_up) : f32[T, 32]
%1 = slice(%0) {start=0, stop=16} : f32[T, 16]
%2 = silu(%1) : f32[T, 16]
%3 = slice(%0) {start=16, stop=32} : f32[T, 16]
%4 = mul(%2, %3) : f32[T, 16]
%5 = matmul(%4, %w_down) : f32[T, 8]
%6 = matmul(%5, %embed) {transpose_b=true} : f32[T, 32]
output logits = %6
"""


def test_quantize_int8_text():
    # The tied LM head (transpose_b on the embedding table) stays f32; quantized params keep
    # their source's recipe (the concat) so the runtime can rebuild them.
    assert run_pass(QUANT_TEXT, quantize_int8) == """\
input %x : f32[T, 8]
param %embed : f32[32, 8] role=embed
param %w_gate_up.int8 : i8[8, 32] {concat=["w_gate", "w_up"], quantize_int8="w_gate_up"} role=gate_up
param %w_gate_up.scale : f32[32] {concat=["w_gate", "w_up"], int8_scale="w_gate_up"} role=gate_up
param %w_down.int8 : i8[16, 8] {quantize_int8="w_down"} role=down
param %w_down.scale : f32[8] {int8_scale="w_down"} role=down
%0 = matmul_int8(%x, %w_gate_up.int8, %w_gate_up.scale) : f32[T, 32]
%1 = slice(%0) {start=0, stop=16} : f32[T, 16]
%2 = silu(%1) : f32[T, 16]
%3 = slice(%0) {start=16, stop=32} : f32[T, 16]
%4 = mul(%2, %3) : f32[T, 16]
%5 = matmul_int8(%4, %w_down.int8, %w_down.scale) : f32[T, 8]
%6 = matmul(%5, %embed) {transpose_b=true} : f32[T, 32]
output logits = %6
"""


POOL_TEXT = """\
meta {model="hand"}
input %k : f32[T, 2, 8]
input %v : f32[T, 2, 8]
input %slot_mapping : i32[T]
input %k_pool.0 : f32[B, 4, 2, 8]
input %v_pool.0 : f32[B, 4, 2, 8]
%0 = kv_write(%k_pool.0, %k, %slot_mapping) : f32[B, 4, 2, 8]
%1 = kv_write(%v_pool.0, %v, %slot_mapping) : f32[B, 4, 2, 8]
output k_pool.0 = %0
output v_pool.0 = %1
"""


def test_plan_memory_text():
    # By hand, for bucket (T=4, S=2): the kv_writes update the donated pools in place, so there
    # are no temporaries; the step's own buffers are k and v (4 x 2 x 8 x 4 B each) and
    # slot_mapping (4 x 4 B): 528 B. A block holds 4 tokens x 2 heads x 8 x 4 B for k and for v:
    # 512 B. With no weights: floor((1.0 x 65536 - 0 - 528 - 0) / 512) = 126 blocks.
    fn = partial(plan_memory, buckets=[(4, 2)], device_memory_bytes=65536, memory_utilization=1.0,
                 block_size=4, max_model_len=16)
    assert run_pass(POOL_TEXT, fn) == POOL_TEXT.replace('meta {model="hand"}',
                                                        'meta {model="hand", num_kv_blocks=126}')


# ============================================================================ (c) no match -> same object

def test_passes_that_match_nothing_return_their_input():
    plain = verify(parse_graph(MLP_TEXT.replace("%2 = matmul(%x, %w_up)", "%2 = matmul(%1, %w_up)")
                               .replace("%w_up : f32[8, 16]", "%w_up : f32[16, 16]")))
    no_int8 = verify(parse_graph("""\
input %x : f32[T, 8]
param %embed : f32[32, 8] role=embed
%0 = matmul(%x, %embed) {transpose_b=true} : f32[T, 32]
output logits = %0
"""))
    textbook = lower(get_preset("tiny"))
    fused = fuse_attention(textbook)
    paged = insert_paged_kv(fused)
    plan = partial(plan_memory, buckets=[(8, 4)], device_memory_bytes=1 << 30, memory_utilization=0.9,
                   block_size=16, max_model_len=64)
    cases = [
        (fuse_attention, plain), (fuse_attention, fused), (fuse_attention, paged),
        (insert_paged_kv, plain), (insert_paged_kv, textbook), (insert_paged_kv, paged),
        (fuse_matmuls, plain), (fuse_matmuls, fuse_matmuls(paged)),
        (quantize_int8, no_int8), (quantize_int8, quantize_int8(paged)),
        (bf16_matmuls, lower(get_preset("tiny"), "bf16")), (bf16_matmuls, bf16_matmuls(paged)),
        (partial(gguf_blocks, formats={}), paged),
        (plan, plain), (plan, fused),
    ]
    for fn, g in cases:
        assert fn(g) is g, getattr(fn, "__name__", fn)
    opts = PipelineOptions()
    for name, fn in build_pipeline(opts):
        if name in ("gguf_blocks", "quantize_int8", "bf16_matmuls", "shard"):  # off by default: identity
            assert fn(paged) is paged


# ============================================================================ pipeline

def test_pipeline_final_graph_is_the_served_graph():
    g = run_pipeline(lower(get_preset("tiny")), PipelineOptions(buckets=((8, 4),), max_model_len=64))
    ops = g.op_counts()
    assert "softmax" not in ops and "causal_mask" not in ops and "einsum" not in ops
    assert ops["kv_write"] == 4 and ops["paged_attention"] == 2
    names = {p.name for p in g.params}
    assert {"layers.0.wqkv", "layers.0.w_gate_up", "layers.1.wqkv", "layers.1.w_gate_up"} <= names
    assert not names & {"layers.0.wq", "layers.0.wk", "layers.0.wv", "layers.0.w_gate", "layers.0.w_up"}
    assert not any("_cache" in x.name for x in g.runtime_inputs)
    assert g.meta_value("num_kv_blocks") > 0


def test_no_softmax_in_attention_position_after_fuse_attention():
    for name in ("tiny", "smollm2-135m"):
        g = fuse_attention(lower(get_preset(name)))
        assert all(n.op not in ("softmax", "causal_mask", "einsum", "repeat_kv") for n in g.nodes())
        assert g.op_counts()["attention"] == get_preset(name).num_layers


def test_pipeline_verifies_after_every_pass(monkeypatch):
    calls = []
    real = pipeline_mod.verify
    monkeypatch.setattr(pipeline_mod, "verify", lambda g: calls.append(g) or real(g))
    seen = []
    run_pipeline(lower(get_preset("tiny")), PipelineOptions(), on_pass=lambda i, n, g: seen.append(n))
    assert len(calls) == len(seen) + 1 == len(build_pipeline(PipelineOptions())) + 1

    def broken(g: Graph) -> Graph:  # a pass that forgets to declare a leaf it still uses
        return Graph(g.inputs[1:], g.outputs, g.meta)

    monkeypatch.setattr(pipeline_mod, "build_pipeline", lambda opts: [("broken", broken)])
    with pytest.raises(VerifyError, match="does not declare"):
        run_pipeline(lower(get_preset("tiny")), PipelineOptions())


# ============================================================================ (b) numerics on the tiny model

CONFIG = get_preset("tiny")
BLOCK_SIZE = 4
NUM_BLOCKS = 16
MAX_BLOCKS = 4          # blocks per sequence (M): 16 positions
CACHE_LEN = 16          # contiguous cache length (L)
NUM_TOKENS = 8          # every step is padded to one bucket: T = 8 tokens ...
NUM_SEQS = 4            # ... of at most 4 sequences (paged S); the contiguous cache holds 3
# Per step: (sequence, first position, number of tokens).
STEPS = [
    [(0, 0, 5), (1, 0, 3)],              # prefill two prompts
    [(0, 5, 1), (1, 3, 4), (2, 0, 2)],   # decode, chunked prefill over a cached prefix, new prompt, 1 pad
    [(0, 6, 1), (1, 7, 1), (2, 2, 1)],   # decode all three, 5 pads
]
NUM_CACHE_SEQS = 3


@functools.cache
def _weights():
    return random_weights(CONFIG, seed=0)


@functools.cache
def _streams():
    return np.random.default_rng(1).integers(3, CONFIG.vocab_size, (NUM_CACHE_SEQS, CACHE_LEN)).astype(np.int32)


@functools.cache
def _tables():
    perm = np.random.default_rng(2).permutation(NUM_BLOCKS).astype(np.int32)
    return perm[:NUM_CACHE_SEQS * MAX_BLOCKS].reshape(NUM_CACHE_SEQS, MAX_BLOCKS)


def _token_rows(step):
    tokens, positions, seqs = [], [], []
    for seq, start, n in step:
        for p in range(start, start + n):
            tokens.append(_streams()[seq, p])
            positions.append(p)
            seqs.append(seq)
    return np.array(tokens, np.int32), np.array(positions, np.int32), np.array(seqs, np.int32)


def _pad(x, n, value):
    return np.concatenate([x, np.full(n - len(x), value, x.dtype)])


def contiguous_inputs(step):
    tokens, positions, seqs = _token_rows(step)
    return {"tokens": _pad(tokens, NUM_TOKENS, 0), "positions": _pad(positions, NUM_TOKENS, 0),
            # Padding tokens name sequence S (out of range): their cache writes are dropped.
            "seq_ids": _pad(seqs, NUM_TOKENS, NUM_CACHE_SEQS),
            "logits_indices": np.arange(NUM_TOKENS, dtype=np.int32)}


def paged_inputs(step):
    tokens, positions, seqs = _token_rows(step)
    tables = _tables()
    slots = tables[seqs, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    block_tables = np.zeros((NUM_SEQS, MAX_BLOCKS), np.int32)
    context_lens = np.zeros(NUM_SEQS, np.int32)
    cu = np.zeros(NUM_SEQS + 1, np.int32)
    for i, (seq, start, n) in enumerate(step):
        block_tables[i] = tables[seq]
        context_lens[i] = start + n
        cu[i + 1] = cu[i] + n
    cu[len(step) + 1:] = cu[len(step)]  # padding sequences: no queries, no context
    return {"tokens": _pad(tokens, NUM_TOKENS, 0), "positions": _pad(positions, NUM_TOKENS, 0),
            "slot_mapping": _pad(slots.astype(np.int32), NUM_TOKENS, -1), "block_tables": block_tables,
            "context_lens": context_lens, "cu_q_lens": cu,
            "logits_indices": np.arange(NUM_TOKENS, dtype=np.int32)}


def run_schedule(graph: Graph):
    """Runs STEPS through the graph: per step, the real tokens' logits; and the final KV state."""
    params = to_device_params(graph, materialize(graph, _weights()))
    names = set(state_names(graph))
    env = {"S": NUM_CACHE_SEQS, "L": CACHE_LEN, "B": NUM_BLOCKS}
    state = {x.name: np.zeros([env.get(d, d) for d in x.shape], JNP_DTYPES[x.dtype])
             for x in graph.runtime_inputs if x.name in names}
    paged = any("_pool." in n for n in names)
    fn = jit_step(graph)
    logits = []
    for step in STEPS:
        inputs = paged_inputs(step) if paged else contiguous_inputs(step)
        wanted = {x.name for x in graph.runtime_inputs} - names
        outs, state = fn(params, state, {k: v for k, v in inputs.items() if k in wanted})
        n = sum(s[2] for s in step)
        logits.append(np.asarray(outs["logits"])[:n])
    return logits, jax.device_get(state)


@functools.cache
def _graphs():
    textbook = lower(CONFIG)
    fused = fuse_attention(textbook)
    paged = insert_paged_kv(fused, block_size=BLOCK_SIZE)
    matmuls = fuse_matmuls(paged)
    quant = quantize_int8(matmuls)
    planned = plan_memory(matmuls, buckets=[(NUM_TOKENS, NUM_SEQS)], device_memory_bytes=1 << 30,
                          memory_utilization=0.9, block_size=BLOCK_SIZE, max_model_len=CACHE_LEN)
    return dict(textbook=textbook, fuse_attention=fused, insert_paged_kv=paged, fuse_matmuls=matmuls,
                quantize_int8=quant, plan_memory=planned)


@functools.cache
def _results(name):
    return run_schedule(verify(_graphs()[name]))


def _assert_same_logits(a, b, **tol):
    for step, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_allclose(x, y, err_msg=f"step {step}", **(tol or F32_TOL))


def test_schedule_exercises_the_cache():
    # Sanity of the harness: the logits of a later step depend on what earlier steps cached.
    ref, _ = _results("textbook")
    assert all(np.isfinite(x).all() for x in ref)
    assert ref[1].shape == (7, CONFIG.vocab_size) and ref[2].shape == (3, CONFIG.vocab_size)
    # Step 2's decode of sequence 0 sees its 6 cached tokens: it differs from a fresh prefill of
    # the same token at the same position with nothing cached.
    alone = run_schedule_single(lower(CONFIG), seq=0, pos=5)
    assert not np.allclose(alone, ref[1][0], atol=1e-4)


def run_schedule_single(graph, seq, pos):
    """The logits of one token at `pos` with an empty cache (for the harness sanity check)."""
    params = to_device_params(graph, materialize(graph, _weights()))
    state = {x.name: np.zeros((NUM_CACHE_SEQS, CACHE_LEN) + tuple(x.shape[2:]), np.float32)
             for x in graph.runtime_inputs if "_cache." in x.name}
    inputs = contiguous_inputs([(seq, pos, 1)])
    outs, _ = jit_step(graph)(params, state, inputs)
    return np.asarray(outs["logits"])[0]


def test_fuse_attention_keeps_logits():
    _assert_same_logits(_results("fuse_attention")[0], _results("textbook")[0])


def test_insert_paged_kv_keeps_logits_and_writes_kv_exactly():
    logits, pools = _results("insert_paged_kv")
    ref, caches = _results("textbook")
    _assert_same_logits(logits, ref)
    # The pools hold, block by block through the permuted tables, the contiguous cache. Layer 0's
    # k/v come from identical ops in both graphs, so there the data movement must be bit-exact;
    # deeper layers inherit the attention's f32 rounding differences.
    tables = _tables()
    lengths = {0: 7, 1: 8, 2: 3}
    for layer in range(CONFIG.num_layers):
        for kv in "kv":
            pool = pools[f"{kv}_pool.{layer}"]
            cache = caches[f"{kv}_cache.{layer}"]
            for seq, n in lengths.items():
                got = pool[tables[seq]].reshape((MAX_BLOCKS * BLOCK_SIZE,) + pool.shape[2:])[:n]
                if layer == 0:
                    np.testing.assert_array_equal(got, cache[seq, :n])
                else:
                    np.testing.assert_allclose(got, cache[seq, :n], **F32_TOL)
    # Blocks no sequence owns were never written (padding slots are dropped).
    used = {tables[0, 0], tables[0, 1], tables[1, 0], tables[1, 1], tables[2, 0]}
    for b in set(range(NUM_BLOCKS)) - used:
        assert not pools["k_pool.0"][b].any()


def test_fuse_matmuls_keeps_logits():
    _assert_same_logits(_results("fuse_matmuls")[0], _results("insert_paged_kv")[0])
    _assert_same_logits(_results("fuse_matmuls")[0], _results("textbook")[0])


def test_plan_memory_keeps_logits():
    _assert_same_logits(_results("plan_memory")[0], _results("fuse_matmuls")[0], **BITWISE)


def test_quantize_int8_logits_stay_close():
    quant, _ = _results("quantize_int8")
    ref, _ = _results("fuse_matmuls")
    for x, y in zip(quant, ref):
        err = np.max(np.abs(x - y)) / np.max(np.abs(y))
        assert 0 < err < 0.03, err
        # The distributions barely move: int8's top choice is among f32's top 5 on every row.
        top5 = np.argsort(-y, axis=-1)[:, :5]
        assert all(a in row for a, row in zip(np.argmax(x, -1), top5))


def test_quantize_int8_params_are_per_channel_int8():
    g = _graphs()["quantize_int8"]
    params = materialize(g, _weights())
    matmul_weights = [n.inputs[1] for n in g.nodes() if n.op == "matmul_int8"]
    assert len(matmul_weights) == 4 * CONFIG.num_layers + 1  # qkv, o, gate_up, down per layer; lm_head
    assert not any(n.op == "matmul" for n in g.nodes())  # untied lm_head is quantized too
    fused = materialize(_graphs()["fuse_matmuls"], _weights())
    for w in matmul_weights:
        q = params[w.name]
        scale = params[w.name.replace(".int8", ".scale")]
        assert q.dtype == np.int8 and w.dtype == "i8"
        assert scale.dtype == np.float32 and scale.shape == (q.shape[1],)  # one per output column
        src = fused[w.attr("quantize_int8")]
        # Symmetric: each column's largest |w| maps to 127, and dequantizing is within half a step.
        np.testing.assert_allclose(scale, np.abs(src).max(axis=0) / 127, **QUANT_SCALE)
        assert np.abs(q).max(axis=0).min() == 127
        assert np.all(np.abs(q.astype(np.float32) * scale - src) <= scale / 2 + 1e-7)
