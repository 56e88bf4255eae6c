"""lower(config) -> Graph: the textbook decoder step over a ragged batch with a contiguous KV cache.

The step takes a flat batch of T tokens from up to S sequences. Each token carries its
sequence id and position; the per-sequence cache is [S, L, kv_heads, head_dim] per layer.
Attention is written out op by op (matmul, scale, mask, softmax, matmul) so that the
passes in `passes/` have something to find and rewrite.

One lowering serves every family: Llama's step, plus what the config turns on (Qwen3's qk-norm;
Gemma's (1 + w) norms, sandwich norms, GeGLU, embedding scale, softcaps, and per-layer sliding
windows and RoPE bases). Each feature is an op or an attribute in the graph, so the passes and the
runtime see what to do and never ask which model it is.
"""

from __future__ import annotations

from ir import Graph, Role, input_node, make_node, param_node
from models.config import ModelConfig

# Symbolic dims, bound per bucket: tokens, sequences, logit rows, cache length.
T, S, R, L = "T", "S", "R", "L"


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical weight names and shapes; matmul weights are [in, out]."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"embed": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm"] = (c.hidden_size,)
        shapes[p + "wq"] = (c.hidden_size, c.q_size)
        shapes[p + "wk"] = (c.hidden_size, c.kv_size)
        shapes[p + "wv"] = (c.hidden_size, c.kv_size)
        if c.qkv_bias:
            shapes[p + "bq"] = (c.q_size,)
            shapes[p + "bk"] = (c.kv_size,)
            shapes[p + "bv"] = (c.kv_size,)
        if c.qk_norm:
            shapes[p + "q_norm"] = (c.head_dim,)
            shapes[p + "k_norm"] = (c.head_dim,)
        shapes[p + "wo"] = (c.q_size, c.hidden_size)
        if c.sandwich_norms:
            shapes[p + "post_attn_norm"] = (c.hidden_size,)
        shapes[p + "mlp_norm"] = (c.hidden_size,)
        if c.is_moe(i):
            e, inter = c.num_experts, c.expert_size
            shapes[p + "router"] = (c.hidden_size, e)
            shapes[p + "experts_gate"] = (e, c.hidden_size, inter)
            shapes[p + "experts_up"] = (e, c.hidden_size, inter)
            shapes[p + "experts_down"] = (e, inter, c.hidden_size)
        else:
            shapes[p + "w_gate"] = (c.hidden_size, c.intermediate_size)
            shapes[p + "w_up"] = (c.hidden_size, c.intermediate_size)
            shapes[p + "w_down"] = (c.intermediate_size, c.hidden_size)
        if c.sandwich_norms:
            shapes[p + "post_mlp_norm"] = (c.hidden_size,)
    shapes["final_norm"] = (c.hidden_size,)
    if not c.tie_embeddings:
        shapes["lm_head"] = (c.hidden_size, c.vocab_size)
    return shapes


# The role of each canonical weight, by the last part of its name (see ir.attrs.Role).
WEIGHT_ROLES = {
    "embed": Role.EMBED, "lm_head": Role.LM_HEAD, "final_norm": Role.FINAL_NORM,
    "attn_norm": Role.ATTN_NORM, "mlp_norm": Role.MLP_NORM,
    "post_attn_norm": Role.POST_ATTN_NORM, "post_mlp_norm": Role.POST_MLP_NORM,
    "q_norm": Role.Q_NORM, "k_norm": Role.K_NORM,
    "wq": Role.Q, "wk": Role.K, "wv": Role.V, "wo": Role.O,
    "bq": Role.Q_BIAS, "bk": Role.K_BIAS, "bv": Role.V_BIAS,
    "w_gate": Role.GATE, "w_up": Role.UP, "w_down": Role.DOWN,
    "router": Role.ROUTER, "experts_gate": Role.EXPERT_GATE, "experts_up": Role.EXPERT_UP,
    "experts_down": Role.EXPERT_DOWN,
}


def lower(config: ModelConfig, dtype: str = "f32") -> Graph:
    """Lowers a config to the textbook step graph (no weights needed)."""
    c = config
    dt = dtype
    params = {name: param_node(name, shape, dt, role=WEIGHT_ROLES[name.rsplit(".", 1)[-1]])
              for name, shape in weight_shapes(c).items()}
    tokens = input_node("tokens", (T,), "i32")
    positions = input_node("positions", (T,), "i32")
    seq_ids = input_node("seq_ids", (T,), "i32")
    logits_indices = input_node("logits_indices", (R,), "i32")
    caches = {}
    for i in range(c.num_layers):
        for kv in ("k", "v"):
            caches[f"{kv}_cache.{i}"] = input_node(f"{kv}_cache.{i}", (S, L, c.num_kv_heads, c.head_dim), dt)

    def linear(x, w, b=None):
        y = make_node("matmul", (x, params[w]))
        return make_node("add", (y, params[b])) if b else y

    def norm(x, w):
        attrs = {"eps": c.rms_eps} | ({"offset": c.norm_offset} if c.norm_offset else {})
        return make_node("rms_norm", (x, params[w]), attrs)

    def dense_mlp(x, p):
        g = make_node(c.hidden_act, (linear(x, p + "w_gate"),))
        return linear(make_node("mul", (g, linear(x, p + "w_up"))), p + "w_down")

    def moe_mlp(x, p):
        """The router picks k experts per token (ids, f32 weights); the experts run on their tokens."""
        logits = linear(x, p + "router")
        ids = make_node("router_topk", (logits,), {"top_k": c.num_experts_per_tok})
        scoring = {"scoring": c.router_scoring} | ({"norm_topk_prob": True} if c.norm_topk_prob else {})
        weights = make_node("router_weights", (logits, ids), scoring)
        experts = tuple(params[p + n] for n in ("experts_gate", "experts_up", "experts_down"))
        return make_node("moe_experts", (x, ids, weights) + experts, {"act": c.hidden_act})

    n_rep = c.num_q_heads // c.num_kv_heads
    h = make_node("embedding", (params["embed"], tokens))
    if c.embed_scale is not None:
        h = make_node("scale", (h,), {"value": c.embed_scale})
    new_caches = []
    for i in range(c.num_layers):
        p = f"layers.{i}."
        x = norm(h, p + "attn_norm")
        bias = c.qkv_bias
        q = linear(x, p + "wq", p + "bq" if bias else None)
        k = linear(x, p + "wk", p + "bk" if bias else None)
        v = linear(x, p + "wv", p + "bv" if bias else None)
        q = make_node("reshape", (q,), {"shape": (T, c.num_q_heads, c.head_dim)})
        k = make_node("reshape", (k,), {"shape": (T, c.num_kv_heads, c.head_dim)})
        v = make_node("reshape", (v,), {"shape": (T, c.num_kv_heads, c.head_dim)})
        if c.qk_norm:
            q, k = norm(q, p + "q_norm"), norm(k, p + "k_norm")
        theta, scaling = c.layer_rope(i)
        rope_attrs = {"theta": theta} | ({"scaling": scaling} if scaling else {})
        q = make_node("rope", (q, positions), rope_attrs)
        k = make_node("rope", (k, positions), rope_attrs)
        kc = make_node("kv_cache_update", (caches[f"k_cache.{i}"], k, seq_ids, positions))
        vc = make_node("kv_cache_update", (caches[f"v_cache.{i}"], v, seq_ids, positions))
        new_caches += [(f"k_cache.{i}", kc), (f"v_cache.{i}", vc)]
        kg = make_node("gather_rows", (kc, seq_ids))  # [T, L, kvh, D]
        vg = make_node("gather_rows", (vc, seq_ids))
        if n_rep > 1:
            kg = make_node("repeat_kv", (kg,), {"n_rep": n_rep})
            vg = make_node("repeat_kv", (vg,), {"n_rep": n_rep})
        s = make_node("einsum", (q, kg), {"eq": "thd,tlhd->thl"})
        s = make_node("scale", (s,), {"value": c.attn_scale})
        if c.attn_logit_softcap is not None:
            s = make_node("softcap", (s,), {"cap": c.attn_logit_softcap})
        window = c.layer_window(i)
        s = make_node("causal_mask", (s, positions), {"window": window} if window else None)
        pr = make_node("softmax", (s,))
        o = make_node("einsum", (pr, vg), {"eq": "thl,tlhd->thd"})
        o = make_node("reshape", (o,), {"shape": (T, c.q_size)})
        o = linear(o, p + "wo")
        if c.sandwich_norms:
            o = norm(o, p + "post_attn_norm")
        h = make_node("add", (h, o))
        x = norm(h, p + "mlp_norm")
        m = moe_mlp(x, p) if c.is_moe(i) else dense_mlp(x, p)
        if c.sandwich_norms:
            m = norm(m, p + "post_mlp_norm")
        h = make_node("add", (h, m))
    hidden = h  # every token's final hidden state, for prompt logprobs
    h = make_node("gather_rows", (h, logits_indices))
    h = norm(h, "final_norm")
    if c.tie_embeddings:
        logits = make_node("matmul", (h, params["embed"]), {"transpose_b": True})
    else:
        logits = make_node("matmul", (h, params["lm_head"]))
    if c.final_logit_softcap is not None:
        logits = make_node("softcap", (logits,), {"cap": c.final_logit_softcap})
    inputs = (tokens, positions, seq_ids, logits_indices) + tuple(caches.values()) + tuple(params.values())
    meta = {"model": c.name, "dtype": dt, "num_layers": c.num_layers}
    from ir.graph import freeze_attrs

    outputs = (("logits", logits), ("hidden", hidden)) + tuple(new_caches)
    return Graph(inputs, outputs, freeze_attrs(meta))
