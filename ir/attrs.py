"""The attribute names, and the closed set of param roles, that models/, passes/ and runtime/ share.

A param's `role` says what the weight is, whatever it is named: passes and the runtime find
weights by role, and names only key the weight files. The printer writes a leaf's role after
its type and attributes (`param %layers.0.wq : f32[64, 64] role=q`).

Passes that make params give them roles too: fuse_matmuls' concatenations take the fused role
of their parts (`FUSED_ROLES`: q/k/v -> qkv, gate/up -> gate_up); quantize_int8's `X.int8` and
`X.scale` both keep X's role, and tell themselves apart by the recipe attribute each carries
(`QUANTIZE_INT8` on the int8 weight, `INT8_SCALE` on its per-column scale). bf16_matmuls'
`X.bf16` keeps X's role, except the [hidden, vocab] copy of a tied embedding, which is an LM head;
gguf_blocks' `X.<format>` likewise (a tied embedding's blocks serve its LM head).
"""

from __future__ import annotations

ROLE = "role"

# Compile-time recipes a param may carry (runtime.worker.params applies them to the weights).
CONCAT = "concat"  # value = concatenation of these source weights on the last axis
QUANTIZE_INT8 = "quantize_int8"  # int8 copy of this source weight
INT8_SCALE = "int8_scale"  # per-output-column scale of this source weight's int8 copy
INT8_TRANSPOSED = "int8_transposed"  # ...of the transposed source: a tied embedding's [hidden, vocab]
TP_LAYOUT = "tp_layout"  # per-shard column order of a fused, column-split weight
BF16_COPY = "bf16_copy"  # bf16 copy of this source weight
BF16_TRANSPOSED = "bf16_transposed"  # ...transposed: the [hidden, vocab] copy of a tied embedding
GGUF_BLOCKS = "gguf_blocks"  # GGUF blocks of this source weight (ir.blocks), [N, row bytes]; with
BLOCK_FORMAT = "block_format"  # ...this format; a concat's sources' blocks are stacked by rows
BLOCK_LAYOUT = "block_layout"  # ..."tiles": repacked by ir.blocks.pack_tiles (absent: the file's rows)

# Tensor parallelism: the shard pass's annotations and the one mesh axis they name.
SHARDING, ALL_REDUCE, ALL_GATHER = "sharding", "all_reduce", "all_gather"
SHARDING_ATTRS = (SHARDING, ALL_REDUCE, ALL_GATHER)
TP_AXIS = "tp"

# On paged_attention (insert_paged_kv): true when the pools it reads are the kv_write results
# of this step's own k/v, so the new tokens' keys and values are already in the pool.
NEW_KV_WRITTEN = "new_kv_written"

# Annotations that are not part of any op's semantics: the executor strips them before calling
# an op's implementation.
ANNOTATION_ATTRS = SHARDING_ATTRS + (NEW_KV_WRITTEN,)


class Role:
    """The closed set of param roles (the values of the `role` attribute)."""

    EMBED = "embed"  # [vocab, hidden] token embedding (also the LM head when tied)
    LM_HEAD = "lm_head"  # [hidden, vocab]
    FINAL_NORM = "final_norm"
    ATTN_NORM = "attn_norm"
    MLP_NORM = "mlp_norm"
    POST_ATTN_NORM, POST_MLP_NORM = "post_attn_norm", "post_mlp_norm"  # on the sublayers' outputs (Gemma)
    Q_NORM, K_NORM = "q_norm", "k_norm"  # [head_dim]: qk-norm, per head (Qwen3, Gemma 3)
    Q, K, V, O = "q", "k", "v", "o"  # attention projections, [in, out]
    Q_BIAS, K_BIAS, V_BIAS = "q_bias", "k_bias", "v_bias"
    GATE, UP, DOWN = "gate", "up", "down"  # SwiGLU MLP, [in, out]
    QKV, QKV_BIAS, GATE_UP = "qkv", "qkv_bias", "gate_up"  # made by fuse_matmuls
    ROUTER = "router"  # mixture of experts: [hidden, experts], the router's logits
    # The experts' stacked SwiGLU weights, each expert's [in, out]: gate/up [E, hidden, I], down [E, I, hidden].
    EXPERT_GATE, EXPERT_UP, EXPERT_DOWN = "expert_gate", "expert_up", "expert_down"


ROLES = frozenset(v for k, v in vars(Role).items() if k.isupper())

# fuse_matmuls: the role of a concatenation of params with these roles, in this order.
FUSED_ROLES = {(Role.Q, Role.K, Role.V): Role.QKV, (Role.Q_BIAS, Role.K_BIAS, Role.V_BIAS): Role.QKV_BIAS,
               (Role.GATE, Role.UP): Role.GATE_UP}


def role_of(node) -> str | None:
    return node.attr(ROLE)


def is_int8_scale(node) -> bool:
    return node.attr(INT8_SCALE) is not None
