"""The ops and attributes the Qwen3 and Gemma families add, each against a plain numpy reference:
gelu_tanh, softcap, rms_norm's (offset + w) over a head axis (qk-norm), causal_mask and the
attention ops' sliding window and softcap; their verifier rules; and the printer/parser round
trip of a graph that uses all of them, through every pass."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from ir import IRError, OPS, input_node, make_node, param_node, parse_graph, print_graph, verify
from models.config import ModelConfig
from models.llama import lower
from passes.pipeline import PipelineOptions, run_pipeline
from tolerances import SAME_MATH_F32

RNG = np.random.default_rng(0)


def _impl(op, *args, **attrs):
    return np.asarray(OPS[op].impl(*(jnp.asarray(a) for a in args), **attrs))


@pytest.mark.parametrize("shape", [(7,), (5, 33), (3, 4, 16)])
def test_gelu_tanh_is_the_tanh_formula(shape):
    x = RNG.standard_normal(shape).astype(np.float32) * 3
    want = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.astype(np.float64) ** 3)))
    np.testing.assert_allclose(_impl("gelu_tanh", x), want, **SAME_MATH_F32)


@pytest.mark.parametrize("cap", [0.5, 30.0, 50])
def test_softcap_is_cap_tanh_x_over_cap(cap):
    x = RNG.standard_normal((6, 40)).astype(np.float32) * 60
    np.testing.assert_allclose(_impl("softcap", x, cap=cap), cap * np.tanh(x.astype(np.float64) / cap),
                               **SAME_MATH_F32)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(9, 64), (5, 3, 16)])
def test_rms_norm_scales_by_offset_plus_weight_over_the_last_axis(offset, shape):
    """A [T, heads, head_dim] input is normalized per head (qk-norm), by (offset + w)."""
    x = RNG.standard_normal(shape).astype(np.float32)
    w = RNG.standard_normal(shape[-1]).astype(np.float32) * 0.3
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + 1e-6) * (offset + w)
    np.testing.assert_allclose(_impl("rms_norm", x, w, eps=1e-6, offset=offset), want, **SAME_MATH_F32)


@pytest.mark.parametrize("window", [None, 1, 3, 8])
def test_causal_mask_window(window):
    s = RNG.standard_normal((4, 2, 10)).astype(np.float32)
    pos = np.array([0, 3, 7, 9], np.int32)
    got = _impl("causal_mask", s, pos, **({"window": window} if window else {}))
    for t, p in enumerate(pos):
        for k in range(10):
            seen = k <= p and (window is None or k > p - window)
            assert np.isfinite(got[t, :, k]).all() == seen, (t, k)


def _attention_numpy(q, k, v, pos, scale, window, softcap):
    """One sequence: q [T, hq, d] at positions pos over k, v [L, hkv, d], float64."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1).astype(np.float64), np.repeat(v, rep, axis=1).astype(np.float64)
    s = np.einsum("thd,lhd->thl", q.astype(np.float64), k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    keys = np.arange(k.shape[0])
    keep = (keys[None, :] <= pos[:, None]) & ((keys[None, :] > pos[:, None] - window) if window else True)
    s = np.where(keep[:, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("thl,lhd->thd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("window,softcap", [(None, 2.0), (5, None), (5, 1.5), (16, None)])
def test_attention_and_paged_attention_window_and_softcap(window, softcap):
    """Both references against numpy, on one 23-token sequence (the paged one through a permuted
    table of 4-token blocks, its last block partly filled)."""
    L, hq, hkv, d, bs = 23, 4, 2, 8, 4
    q = RNG.standard_normal((L, hq, d)).astype(np.float32) * 2
    k = RNG.standard_normal((L, hkv, d)).astype(np.float32)
    v = RNG.standard_normal((L, hkv, d)).astype(np.float32)
    pos = np.arange(L, dtype=np.int32)
    attrs = dict(scale=d ** -0.5, num_kv_heads=hkv, head_dim=d) | ({"window": window} if window else {}) \
        | ({"softcap": softcap} if softcap else {})
    want = _attention_numpy(q, k, v, pos, d ** -0.5, window, softcap)
    cache = lambda x: np.pad(x, ((0, 32 - L), (0, 0), (0, 0)))[None]  # noqa: E731  [1, 32, hkv, d]
    got = _impl("attention", q, cache(k), cache(v), np.zeros(L, np.int32), pos, causal=True, **attrs)
    np.testing.assert_allclose(got, want, **SAME_MATH_F32)
    table = RNG.permutation(10)[:8].astype(np.int32)
    k_pool, v_pool = np.zeros((10, bs, hkv, d), np.float32), np.zeros((10, bs, hkv, d), np.float32)
    k_pool[table] = cache(k)[0].reshape(8, bs, hkv, d)
    v_pool[table] = cache(v)[0].reshape(8, bs, hkv, d)
    got = _impl("paged_attention", q, k_pool, v_pool, table[None], np.array([L], np.int32),
                np.array([0, L], np.int32), block_size=bs, **attrs)
    np.testing.assert_allclose(got, want, **SAME_MATH_F32)


@pytest.mark.parametrize("op,attrs,rule", [
    ("causal_mask", {"window": 0}, "window must be a positive int"),
    ("causal_mask", {"window": 2.5}, "window must be a positive int"),
    ("causal_mask", {"softcap": 3.0}, "causal_mask takes no softcap"),
    ("softcap", {"cap": -1.0}, "softcap cap must be a positive number"),
    ("attention", {"softcap": 0}, "attention softcap must be a positive number"),
    ("attention", {"window": 4, "causal": False}, "attention with a window must be causal"),
])
def test_verifier_rules(op, attrs, rule):
    x = input_node("s", ("T", 4, "L"), "f32")
    pos = input_node("pos", ("T",), "i32")
    if op == "attention":
        q, cache = input_node("q", ("T", 4, 8), "f32"), input_node("c", ("S", "L", 2, 8), "f32")
        inputs = (q, cache, cache, pos, pos)
        attrs = dict(scale=0.3, causal=True, num_kv_heads=2, head_dim=8) | attrs
    else:
        inputs = (x, pos) if op == "causal_mask" else (x,)
    with pytest.raises(IRError, match=rule):
        make_node(op, inputs, attrs)


GEMMA_LIKE = ModelConfig(name="gemma-like", num_layers=3, hidden_size=64, intermediate_size=96, num_q_heads=4,
                         num_kv_heads=2, head_dim=32, vocab_size=128, tie_embeddings=True, qk_norm=True,
                         norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=8.0,
                         query_pre_attn_scalar=24.0, attn_logit_softcap=50.0, final_logit_softcap=30.0,
                         sliding_window=8, layer_types=("sliding", "sliding", "full"), rope_local_theta=10.0,
                         rope_theta=1e6, rope_scaling=(("factor", 8.0), ("rope_type", "linear")))


def test_gemma_like_graph_round_trips_through_every_pass():
    """Every new op and attribute prints and parses back to the same graph, verified, after each pass;
    the final graph's attention ops carry each layer's window, softcap and RoPE base."""
    texts = []
    final = run_pipeline(lower(GEMMA_LIKE), PipelineOptions(block_size=4, max_model_len=32, buckets=((8, 2),)),
                         on_pass=lambda i, name, g: texts.append(print_graph(g)))
    for text in [print_graph(lower(GEMMA_LIKE))] + texts:
        back = verify(parse_graph(text))
        assert print_graph(back) == text
    ops = final.op_counts()
    assert ops["gelu_tanh"] == 3 and ops["softcap"] == 1 and ops["paged_attention"] == 3
    attn = [n for n in final.nodes() if n.op == "paged_attention"]
    assert [n.attr("window") for n in attn] == [8, 8, None]
    assert {n.attr("softcap") for n in attn} == {50.0} and {n.attr("scale") for n in attn} == {24.0 ** -0.5}
    ropes = [n for n in final.nodes() if n.op == "rope"]
    assert [dict(n.attrs)["theta"] for n in ropes] == [10.0] * 4 + [1e6] * 2
    assert [n.attr("scaling") for n in ropes][-1] == (("factor", 8.0), ("rope_type", "linear"))
    norms = [n for n in final.nodes() if n.op == "rms_norm"]
    assert len(norms) == 3 * 6 + 1 and all(n.attr("offset") == 1.0 for n in norms)
    text = print_graph(final)
    assert "softcap(" in text and "window=8" in text and "offset=1.0" in text


def test_llama_graphs_do_not_change():
    """The defaults are Llama's: no new op or attribute shows up in its graph."""
    from models.config import get_preset

    text = print_graph(lower(get_preset("tiny")))
    for word in ("softcap", "window", "offset", "gelu_tanh", "q_norm"):
        assert word not in text
