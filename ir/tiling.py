"""The tiling of paged attention's XLA lowering: a contract between the lowering and the memory plan.

runtime.worker.kernels lowers `paged_attention` with these constants, and passes.plan_memory sizes
the lowering's workspace from them. Both may import ir, and neither imports the other: the worker
does not depend on a pass, and a pass models the kernels without importing the runtime.
"""

from __future__ import annotations

# How the executor lowers `paged_attention` on the XLA backend (CPU):
#   "chunked": runtime.worker.kernels.paged_attention_xla, a fori_loop over chunks of XLA_CHUNK_BLOCKS
#              blocks with an online softmax;
#   "gather":  ir.ops.paged_attention_reference, the jnp reference, which gathers every token's
#              whole context at once.
PAGED_ATTENTION_LOWERINGS = ("chunked", "gather")
# The chunked lowering's tiling.
# Blocks of context per loop iteration (256 tokens at the default 32-token blocks).
XLA_CHUNK_BLOCKS = 8
# Buckets past XLA_SELF_MAX_TOKENS with at most this many sequences gather each
# sequence's chunk once and score every token against all of them, masking other sequences:
# S times the score flops, but far less memory traffic than a per-token gather. Past ~4
# sequences the wasted flops cost more than the gather saves (1.5 S flops per gathered byte).
XLA_DENSE_MAX_SEQS = 4
# Prefill-shaped buckets up to this many tokens attend over the step's own new K/V directly (one
# [T, heads, T] score block), and walk the pool only for context from earlier steps; a fresh
# prompt then reads no KV from the pool at all. Larger buckets use the chunked walk alone (the
# score block would be T^2: 151 MB at 2048 tokens with 9 heads).
XLA_SELF_MAX_TOKENS = 2048
# Those buckets then walk the pool per sequence, never per token: decode rows one row each, and
# the tokens of a chunked continuation or prefix hit in tiles of XLA_POOL_TILE tokens against
# chunks of XLA_SEQ_CHUNK_BLOCKS blocks of their own context (512 tokens), each gathered once per
# tile. Fresh prompts read nothing from the pool.
XLA_POOL_TILE = 64
# The per-token walk (decode rows) goes in groups of this many rows, longest context first, each
# group only as far as its own longest context.
XLA_ROW_GROUP = 8
XLA_SEQ_CHUNK_BLOCKS = 32


def uses_new_kv(t: int, s: int) -> bool:
    """Whether the chunked lowering of a (t tokens, s sequences) bucket attends over the step's new
    K/V first (runtime.worker.kernels.paged_attention_xla)."""
    return s < t <= XLA_SELF_MAX_TOKENS
