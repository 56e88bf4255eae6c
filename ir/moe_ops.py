"""The mixture-of-experts ops of the op table: the router (which k of E experts each token runs, and
with what weight) and the expert MLPs over stacked expert weights, with shape rules and jnp references.

    router_topk(logits [T, E]) {top_k}                               -> i32 [T, k]  expert ids
    router_weights(logits [T, E], ids [T, k]) {scoring, norm_topk_prob} -> f32 [T, k]  their weights
    moe_experts(x [T, H], ids [T, k], weights [T, k],
                w_gate [E, H, I], w_up [E, H, I], w_down [E, I, H]
                [, s_gate [E, I], s_up [E, I], s_down [E, H]]) {act}  -> [T, H]

`router_weights`' `scoring`:
    softmax_topk   softmax over all E logits in f32, then the chosen k; with norm_topk_prob=true
                   renormalized to sum to 1 (Qwen3-MoE);
    topk_softmax   softmax over the chosen k logits alone (Mixtral; the same numbers as
                   softmax_topk renormalized).
Ids come from the logits' top-k (softmax is monotone: the probabilities' top-k is the same set);
ties go to the lower expert id, as lax.top_k and torch.topk do.

`moe_experts` is, for each token, sum_j weights[t, j] * down(act(x @ gate[e]) * (x @ up[e])) over
its experts e = ids[t, j]. The reference below is the plain dense form, every expert over every
token with a one-hot combine; the runtime's lowering (runtime.worker.moe.moe_experts_grouped)
sorts the token-expert pairs by expert and runs grouped matmuls, work k/E of the dense form.
With int8 weights (passes.quantize_int8) the op takes three more inputs, each expert's per-output-
channel scales: w[e] ~= w_int8[e] * s[e][None, :].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ir.ops import _float, _int_idx, _need, _rank, _same_dim, impl, op

ROUTER_SCORINGS = ("softmax_topk", "topk_softmax")
EXPERT_ACTS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def _check_logits(logits) -> None:
    _rank(logits, 2, "router logits [T, E]")
    _need(_float(logits.dtype), f"router logits must be floating point, got {logits.dtype}")


def _check_top_k(attrs, num_experts) -> int:
    k = attrs["top_k"]
    _need(isinstance(k, int) and not isinstance(k, bool) and k >= 1, f"router top_k must be an int >= 1, got {k!r}")
    _need(not isinstance(num_experts, int) or k <= num_experts, f"router top_k {k} exceeds the {num_experts} experts")
    return k


@op("router_topk", 1, ("top_k",))
def _router_topk(inputs, attrs):
    (logits,) = inputs
    _check_logits(logits)
    return (logits.shape[0], _check_top_k(attrs, logits.shape[1])), "i32"


@impl("router_topk")
def _router_topk_impl(logits, *, top_k):
    return jax.lax.top_k(logits.astype(jnp.float32), top_k)[1].astype(jnp.int32)


@op("router_weights", 2, ("scoring",))
def _router_weights(inputs, attrs):
    logits, ids = inputs
    _check_logits(logits)
    _rank(ids, 2, "router ids [T, k]")
    _int_idx(ids, "router ids")
    _same_dim(logits.shape[0], ids.shape[0], "router logits and ids need one row per token")
    _need(attrs["scoring"] in ROUTER_SCORINGS,
          f"router_weights scoring must be one of {ROUTER_SCORINGS}, got {attrs['scoring']!r}")
    _need(isinstance(attrs.get("norm_topk_prob", False), bool), "router_weights norm_topk_prob must be a bool")
    _need(not (attrs["scoring"] == "topk_softmax" and attrs.get("norm_topk_prob")),
          "router_weights: topk_softmax weights sum to 1 already; norm_topk_prob goes with softmax_topk")
    return tuple(ids.shape), "f32"


@impl("router_weights")
def _router_weights_impl(logits, ids, *, scoring, norm_topk_prob=False):
    logits = logits.astype(jnp.float32)
    if scoring == "topk_softmax":
        return jax.nn.softmax(jnp.take_along_axis(logits, ids, axis=-1), axis=-1)
    chosen = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), ids, axis=-1)
    return chosen / jnp.sum(chosen, axis=-1, keepdims=True) if norm_topk_prob else chosen


@op("moe_experts", None)
def _moe_experts(inputs, attrs):
    _need(len(inputs) in (6, 9), f"moe_experts takes 6 inputs (9 with int8 scales), got {len(inputs)}")
    x, ids, weights, wg, wu, wd = inputs[:6]
    _rank(x, 2, "moe_experts x [T, H]")
    _need(_float(x.dtype), f"moe_experts x must be floating point, got {x.dtype}")
    _rank(ids, 2, "moe_experts ids [T, k]")
    _int_idx(ids, "moe_experts ids")
    _need(tuple(weights.shape) == tuple(ids.shape) and weights.dtype == "f32",
          f"moe_experts weights must be f32 with the ids' shape {list(ids.shape)}, "
          f"got {weights.dtype}{list(weights.shape)}")
    _same_dim(x.shape[0], ids.shape[0], "moe_experts needs one row of ids per token")
    for w, what in ((wg, "w_gate [E, H, I]"), (wu, "w_up [E, H, I]"), (wd, "w_down [E, I, H]")):
        _rank(w, 3, f"moe_experts {what}")
    _need(tuple(wg.shape) == tuple(wu.shape),
          f"moe_experts gate and up must agree: {list(wg.shape)} vs {list(wu.shape)}")
    e, h, i = wg.shape
    _same_dim(h, x.shape[1], "moe_experts gate/up rows must equal x's hidden size")
    _need(tuple(wd.shape) == (e, i, h), f"moe_experts w_down must be [E, I, H] = {[e, i, h]}, got {list(wd.shape)}")
    _need(not isinstance(ids.shape[1], int) or ids.shape[1] <= e, f"moe_experts: top-k {ids.shape[1]} > {e} experts")
    _need(attrs.get("act", "silu") in EXPERT_ACTS, f"moe_experts act must be one of {sorted(EXPERT_ACTS)}")
    if len(inputs) == 9:
        for w in (wg, wu, wd):
            _need(w.dtype == "i8", f"moe_experts with scales takes i8 weights, got {w.dtype}")
        for s, w, what in zip(inputs[6:], (wg, wu, wd), ("gate", "up", "down")):
            _need(s.dtype == "f32" and tuple(s.shape) == (w.shape[0], w.shape[2]),
                  f"moe_experts {what} scale must be f32 [E, out] = {[w.shape[0], w.shape[2]]}, "
                  f"got {s.dtype}{list(s.shape)}")
    else:
        _need(all(_float(w.dtype) for w in (wg, wu, wd)), "moe_experts without scales takes floating point weights")
    return tuple(x.shape), x.dtype


def expert_weights(wg, wu, wd, scales=()):
    """The experts' weights as floats: int8 ones times their per-expert, per-column scales."""
    if not scales:
        return wg, wu, wd
    return tuple(w.astype(jnp.float32) * s[:, None, :] for w, s in zip((wg, wu, wd), scales))


@impl("moe_experts")
def moe_experts_reference(x, ids, weights, wg, wu, wd, *scales, act="silu"):
    """Dense one-hot reference: every expert runs on every token in f32, and a [T, E] combine
    (the router weights scattered to their experts, zero elsewhere) sums the chosen ones."""
    wg, wu, wd = (w.astype(jnp.float32) for w in expert_weights(wg, wu, wd, scales))
    xf = x.astype(jnp.float32)
    hidden = EXPERT_ACTS[act](jnp.einsum("th,ehi->tei", xf, wg)) * jnp.einsum("th,ehi->tei", xf, wu)
    y = jnp.einsum("tei,eih->teh", hidden, wd)
    combine = jnp.einsum("tke,tk->te", jax.nn.one_hot(ids, wg.shape[0], dtype=jnp.float32), weights)
    return jnp.einsum("teh,te->th", y, combine).astype(x.dtype)
