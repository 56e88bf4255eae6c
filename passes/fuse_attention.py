"""Fuses matmul(q, kᵀ) · scale · softcap? · causal mask · softmax · matmul(·, v) into one `attention` op."""

from __future__ import annotations

from ir import Graph, Node, make_node, rewrite


def _kv_source(node: Node) -> tuple[Node, Node, int] | None:
    """Peels the GQA broadcast and the per-token gather off a K/V operand: (cache, seq_ids, n_rep)."""
    n_rep = 1
    if node.op == "repeat_kv":
        n_rep, node = node.attr("n_rep"), node.inputs[0]
    if node.op != "gather_rows" or len(node.shape) != 4:
        return None
    return node.inputs[0], node.inputs[1], n_rep


def _match(pv: Node):
    if pv.op != "einsum" or pv.attr("eq") != "thl,tlhd->thd":
        return None
    probs, v_op = pv.inputs
    if probs.op != "softmax":
        return None
    masked = probs.inputs[0]
    causal = masked.op == "causal_mask"
    capped = masked.inputs[0] if causal else masked
    softcap = capped.attr("cap") if capped.op == "softcap" else None
    scaled = capped.inputs[0] if softcap is not None else capped
    if scaled.op != "scale":
        return None
    qk = scaled.inputs[0]
    if qk.op != "einsum" or qk.attr("eq") != "thd,tlhd->thl":
        return None
    q, k_op = qk.inputs
    k_src, v_src = _kv_source(k_op), _kv_source(v_op)
    if k_src is None or v_src is None:
        return None
    (k_cache, k_seq, k_rep), (v_cache, v_seq, v_rep) = k_src, v_src
    if k_seq is not v_seq or k_rep != v_rep:
        return None
    positions = masked.inputs[1] if causal else None
    extra = {"window": masked.attr("window") if causal else None, "softcap": softcap}
    return q, k_cache, v_cache, k_seq, positions, scaled.attr("value"), causal, extra


def fuse_attention(graph: Graph) -> Graph:
    """Replaces each textbook attention subgraph with one `attention` op."""

    def fn(node: Node, ins: tuple[Node, ...]) -> Node | None:
        m = _match(Node(node.op, ins, node.attrs, node.shape, node.dtype))
        if m is None:
            return None
        q, k_cache, v_cache, seq_ids, positions, scale, causal, extra = m
        if positions is None:
            return None  # the attention op always carries positions; non-causal stays unfused
        attrs = {"scale": scale, "causal": causal, "num_kv_heads": k_cache.shape[2],
                 "head_dim": q.shape[2]} | {k: v for k, v in extra.items() if v is not None}
        return make_node("attention", (q, k_cache, v_cache, seq_ids, positions), attrs)

    return rewrite(graph, fn)
