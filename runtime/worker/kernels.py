"""Backend lowerings of the attention ops: a blocked XLA loop on CPU (with its decode rows in our
C++ kernel under kernel_backend="cpp", runtime.worker.cpp_kernels), our Pallas kernels on GPU.
Under "cpp", products of decode steps' few rows (f32, W8A8 and weight-only int8, and GGUF blocks)
run in our C++ kernels too.

The jnp references in `ir.ops` gather the whole context of every token at once, which is
clear but sized by max_model_len. The XLA lowering here walks the context in chunks of
blocks with an online softmax, stopping at the longest context in the batch.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ir import OPS
from ir.blocks import round_q8
from ir.int8 import INT8_ACTIVATIONS, w8a8_matmul, weight_only_matmul
from ir.attention_ops import kv_write_reference, softcap_scores
from ir.attention_ops import visible as visible_pos
from ir.tiling import (XLA_CHUNK_BLOCKS, XLA_DENSE_MAX_SEQS,  # the tiling the memory plan sizes
                       XLA_POOL_TILE, XLA_ROW_GROUP, XLA_SEQ_CHUNK_BLOCKS, uses_new_kv)
from runtime.worker import cpp_kernels


# XLA:CPU has no bf16 gather or scatter: it runs one on the whole operand widened to f32 and, for a
# scatter, narrowed back. On a KV pool that is the pool's size in conversions per kv_write and per
# attention call (26 ms for one 4 GiB-budget SmolLM2 layer's write, against 15 us in f32). So on
# CPU a bf16 pool is stored as its uint16 bits: its writes and gathers move 2-byte integers, and
# the gathered K/V are widened by a shift, since bf16 is the top half of an f32.
BF16_BITS = jnp.uint16

# Query tile of a prefill step's attention over its own tokens (_self_attention).
SELF_TILE = 128

# int8-weight products of at most this many rows (decode steps) run in cpp/matmul.cc where it
# has its vector paths; wider ones keep XLA's products. W8A8: XLA's int8 dot is as fast or faster
# from 8 rows on (docs/benchmarks/, "W8A8 decode rows in our C++ kernel"). Weight-only: XLA's product
# with the weights widened is 1.5-10x slower than the kernel up to 64 rows (a 64-sequence decode
# step), and about even at 128 (docs/benchmarks/, "Weight-only int8 decode rows in our C++ kernel").
CPP_INT8_MAX_ROWS = 4
CPP_INT8_WEIGHT_ONLY_MAX_ROWS = 64
# f32 products of at most this many rows run in cpp/matmul.cc too, where it has its vector paths.
CPP_F32_MAX_ROWS = 8


def pool_storage_dtype(dtype, backend: str):
    """The array dtype that holds a KV pool of jnp `dtype` under `backend` (see BF16_BITS)."""
    if dtype == jnp.bfloat16 and backend in ("xla", "cpp") and jax.default_backend() == "cpu":
        return BF16_BITS
    return dtype


def _f32(x):
    """K/V values in f32; uint16 values are bf16 bits (BF16_BITS)."""
    if x.dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
    return x.astype(jnp.float32)


def kv_write_xla(pool, new, slots):
    """kv_write into a pool in its storage dtype: a uint16 pool takes the bits of bf16-rounded K/V.

    A one-token write goes out as two, the second to slot -1 (dropped). XLA turns a scatter of one
    index into a dynamic-update-slice, and then copies that update into the attention loop's gather
    of the pool that follows, which needs the pool as it was before the write: a copy of the whole
    pool per layer in every one-row step (14 MiB of temporaries for a 1,024-block tiny pool at
    tensor_parallel_size 2, growing with the pool; 1.7 GiB for SmolLM2 at tp=3). A scatter of two
    indices stays a scatter, in place."""
    if pool.dtype == BF16_BITS:
        new = jax.lax.bitcast_convert_type(new.astype(jnp.bfloat16), BF16_BITS)
    if new.shape[0] == 1:
        new = jnp.concatenate([new, new])
        slots = jnp.concatenate([slots, jnp.full((1,), -1, slots.dtype)])
    return kv_write_reference(pool, new, slots)


def matmul_half_cpu(x, w, *, transpose_b=False):
    """A product by a bf16 or f16 weight on XLA:CPU, which has no half-precision dot: the weight is
    widened to f32 (as XLA itself would) where the product runs.

    XLA schedules a widening that depends on nothing but a weight as early as it likes: in a one-row
    step it widened all of SmolLM2's bf16 weights at the top of the program (405 MiB of
    temporaries live at once). Adding zero from the activations (0 x (x0 != x0): never NaN) ties each
    widening to its product, one weight's f32 copy at a time, which the memory plan counts
    (passes.plan_memory, `widen_half_weights`)."""
    x0 = x.reshape(-1)[0]
    zero = (x0 != x0).astype(jnp.float32) * 0.0
    wf = w.astype(jnp.float32) + zero
    wf = wf.T if transpose_b else wf
    return jnp.matmul(x.astype(jnp.float32), wf).astype(x.dtype)


HALF_DTYPES = (jnp.bfloat16, jnp.float16)


def matmul_xla(x, w, *, transpose_b=False):
    """matmul under the XLA lowerings: half-precision weights on CPU as matmul_half_cpu, the rest as
    ir.ops lowers it."""
    if w.dtype in HALF_DTYPES and jax.default_backend() == "cpu":
        return matmul_half_cpu(x, w, transpose_b=transpose_b)
    return OPS["matmul"].impl(x, w, transpose_b=transpose_b)


def _token_layout(cu_q_lens, context_lens, num_tokens):
    """Per token: its sequence and its absolute position (ragged queries at the context's end)."""
    s = context_lens.shape[0]
    tok = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, s - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = context_lens[seq] - q_len + (tok - cu_q_lens[seq])
    pos = jnp.where(tok < cu_q_lens[-1], pos, -1)  # padding tokens see nothing
    return seq, pos


def paged_attention_xla(q, k_pool, v_pool, block_tables, context_lens, cu_q_lens, *, scale,
                        num_kv_heads, block_size, head_dim, chunk_blocks: int = XLA_CHUNK_BLOCKS,
                        k_new=None, v_new=None, row_kernel: bool = False, window=None, softcap=None):
    """Ragged paged attention as an XLA while-loop over context chunks (online softmax, f32).

    With a sliding `window`, each token sees its last `window` positions (ir.attention_ops): the
    walks start at the chunk holding a token's first visible position, so a chunk wholly behind
    every window is never gathered, and mask the rest; `softcap` caps the scores before the mask.

    With `k_new`/`v_new` (this step's K/V [T, kv_heads, d], already written to the pools) in a
    prefill-shaped bucket: the step's tokens first attend over each other (block-diagonal causal),
    and the loop then covers only the context written by earlier steps (prefix hits, earlier
    chunks), merged into the same online softmax. That walk gathers each sequence's context once
    per chunk (`_split_walk`), not once per token: a fresh prompt reads nothing from the pool, and
    a chunked continuation at 900 tokens of context costs a few matmuls, not a gather per token.

    With `row_kernel` (kernel_backend="cpp"), where the head shapes fit it, every token's walk runs
    in our C++ kernel, which reads the pool in place (runtime.worker.cpp_kernels): a prefill
    token's own chunk is in the pool already, so it walks its sequence's positions up to its own,
    and never scores the other sequences packed into the step, as the self-attention tiles do (64
    sequences x 64 tokens 1.16x faster under gguf_activations=q8, and a 512-token TTFT 1.11x;
    docs/benchmarks/, "Int8 products on GGUF blocks"); a prompt's consecutive tokens walk their blocks
    together (cpp_kernels.GROUP_ROWS: a 2,048-token TTFT 1.38x)."""
    t = q.shape[0]
    s, m = block_tables.shape
    c = min(chunk_blocks, m)
    pad = (-m) % c
    tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
    n_rep = q.shape[1] // num_kv_heads
    seq, pos = _token_layout(cu_q_lens, context_lens, t)
    lo = jnp.zeros_like(pos) if window is None else jnp.maximum(pos + 1 - window, 0)  # first visible
    qf = q.astype(jnp.float32).reshape(t, num_kv_heads, n_rep, head_dim) * scale
    pool = dict(tables=tables, k_pool=k_pool, v_pool=v_pool, chunk_blocks=c, block_size=block_size,
                softcap=softcap)
    # The kernel reads f32 pools and bf16 ones stored as their bits; an f16 pool walks in XLA.
    row_kernel = (row_kernel and cpp_kernels.fits(num_kv_heads, n_rep, block_size, head_dim)
                  and k_pool.dtype in (jnp.float32, BF16_BITS))
    if k_new is not None and uses_new_kv(t, s) and not row_kernel:
        mx, den, acc = _self_attention(qf, k_new, v_new, seq, pos, window, softcap)
        start = context_lens - (cu_q_lens[1:] - cu_q_lens[:-1])  # [S] this step's first position
        limit = jnp.where(pos >= 0, start[seq], 0)  # pool context visible to each token: < limit
        den, acc = _split_walk(qf, lo, limit, (mx, den, acc), cu_q_lens, **pool)
    elif row_kernel:  # the kernel's state covers the whole walk: nothing to merge it into
        _, den, acc = cpp_kernels.paged_decode(qf, k_pool, v_pool, tables, seq, pos + 1, start=lo,
                                               softcap=softcap)
    else:
        init = (jnp.full((t, num_kv_heads, n_rep), -1e30, jnp.float32),
                jnp.zeros((t, num_kv_heads, n_rep), jnp.float32),
                jnp.zeros((t, num_kv_heads, n_rep, head_dim), jnp.float32))
        dense = s <= XLA_DENSE_MAX_SEQS and t > s
        den, acc = _pool_walk(qf, seq, lo, pos + 1, init, **pool, dense=dense)
    out = jnp.where(den[..., None] > 0, acc / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    return out.reshape(q.shape).astype(q.dtype)


def _first_chunk(lo, limit, chunk_tokens):
    """The first chunk any of these rows sees (rows with nothing to see count as seeing no chunk)."""
    return jnp.min(jnp.where(limit > 0, lo // chunk_tokens, jnp.iinfo(jnp.int32).max), initial=jnp.iinfo(jnp.int32).max,
                   axis=-1)


def _pool_walk(qf, seq, lo, limit, init, *, tables, k_pool, v_pool, chunk_blocks, block_size, dense, softcap):
    """Online softmax of tokens `qf` [T, kvh, rep, d] (of sequences `seq`) over the pool positions
    in [lo, limit) (each [T]), merged into `init` (max, denominator, accumulator). Returns
    (denominator, accumulator). Chunks wholly below every row's `lo` are skipped.

    The per-token form walks tokens in groups of XLA_ROW_GROUP, longest context first, each group
    only as far as its own longest context: one fori_loop over (group, chunk of `chunk_blocks`
    blocks) pairs. A batch of decode rows with mixed context lengths then costs about the sum of
    their contexts, not rows x the longest. The dense few-sequence form walks every token to the
    largest limit. (With `row_kernel`, paged_attention_xla calls our C++ kernel instead.)
    """
    chunk = functools.partial(_chunk_update, tables=tables, k_pool=k_pool, v_pool=v_pool,
                              chunk_blocks=chunk_blocks, block_size=block_size, dense=dense, softcap=softcap)
    chunk_tokens = chunk_blocks * block_size
    t = qf.shape[0]
    if dense or t <= XLA_ROW_GROUP:
        num_chunks = (jnp.max(limit) + chunk_tokens - 1) // chunk_tokens
        first = jnp.minimum(_first_chunk(lo, limit, chunk_tokens), num_chunks)
        return jax.lax.fori_loop(first, num_chunks, lambda i, carry: chunk(i, qf, seq, lo, limit, carry), init)[1:]
    g = XLA_ROW_GROUP
    n_groups = -(-t // g)
    order = jnp.argsort(-limit)  # longest first, so a group's rows need about as many chunks
    rows = jnp.pad(order, (0, n_groups * g - t), constant_values=t).reshape(n_groups, g)  # t: padding
    row_limit = jnp.where(rows < t, limit[jnp.clip(rows, 0, t - 1)], 0)
    row_lo = lo[jnp.clip(rows, 0, t - 1)]
    group_end = (jnp.max(row_limit, axis=1) + chunk_tokens - 1) // chunk_tokens
    group_first = jnp.minimum(_first_chunk(row_lo, row_limit, chunk_tokens), group_end)
    group_chunks = group_end - group_first
    ends = jnp.cumsum(group_chunks)

    def body(k, state):
        grp = jnp.minimum(jnp.searchsorted(ends, k, side="right"), n_groups - 1)
        i = group_first[grp] + k - (ends[grp] - group_chunks[grp])
        r = rows[grp]
        rc = jnp.clip(r, 0, t - 1)
        new = chunk(i, qf[rc], seq[rc], row_lo[grp], row_limit[grp], tuple(x[rc] for x in state))
        return tuple(x.at[r].set(y, mode="drop") for x, y in zip(state, new))

    return jax.lax.fori_loop(0, ends[-1], body, init)[1:]


def _chunk_update(i, qf, seq, lo, limit, carry, *, tables, k_pool, v_pool, chunk_blocks, block_size, dense,
                  softcap):
    """The online-softmax state `carry` (max, denominator, accumulator) of tokens `qf`, after chunk
    `i` of their sequences' pool context (positions in [lo, limit))."""
    t, num_kv_heads, _, head_dim = qf.shape
    s = tables.shape[0]
    c = chunk_blocks
    chunk_tokens = c * block_size
    cols = jax.lax.dynamic_slice_in_dim(tables, i * c, c, axis=1)  # [S, C]
    kpos = i * chunk_tokens + jnp.arange(chunk_tokens)
    if dense:
        # [S, chunk, kvh, d] once per sequence; the score axis is (sequence, slot).
        k = jnp.take(k_pool, cols, axis=0, mode="clip").reshape(s * chunk_tokens, num_kv_heads, head_dim)
        v = jnp.take(v_pool, cols, axis=0, mode="clip").reshape(s * chunk_tokens, num_kv_heads, head_dim)
        sc = jnp.einsum("tgrd,mgd->tgrm", qf, _f32(k))
        same_seq = jnp.repeat(jnp.arange(s), chunk_tokens)[None, :] == seq[:, None]
        kpos_all = jnp.tile(kpos, s)[None, :]
        visible = (same_seq & (kpos_all < limit[:, None]) & (kpos_all >= lo[:, None]))[:, None, None, :]
    else:
        blocks = jnp.take(cols, seq, axis=0)  # [T, C]
        k = jnp.take(k_pool, blocks, axis=0, mode="clip").reshape(t, chunk_tokens, num_kv_heads, head_dim)
        v = jnp.take(v_pool, blocks, axis=0, mode="clip").reshape(t, chunk_tokens, num_kv_heads, head_dim)
        sc = jnp.einsum("tgrd,tlgd->tgrl", qf, _f32(k))
        visible = ((kpos[None, :] < limit[:, None]) & (kpos[None, :] >= lo[:, None]))[:, None, None, :]
    return _merge(carry, softcap_scores(sc, softcap), visible, v, "tgrl,lgd->tgrd" if dense else "tgrl,tlgd->tgrd")


def _merge(carry, sc, visible, v, pv_spec):
    """The online-softmax state `carry` (max, denominator, accumulator) after scores `sc`
    [T, kvh, rep, L] (positions where `visible` is false masked out) with values `v`, contracted
    by the einsum `pv_spec`."""
    mx, den, acc = carry
    sc = jnp.where(visible, sc, -jnp.inf)
    new_mx = jnp.maximum(mx, jnp.max(sc, axis=-1))
    p = jnp.exp(sc - new_mx[..., None])
    corr = jnp.exp(mx - new_mx)
    pv = jnp.einsum(pv_spec, p, _f32(v))
    return new_mx, den * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv


def _split_walk(qf, first_visible, limit, init, cu_q_lens, *, tables, k_pool, v_pool, chunk_blocks, block_size, softcap):
    """The pool walk of a prefill-shaped step, in two parts that each gather a sequence's earlier
    context once, never once per token:

    1. decode rows (one-token sequences with pool context): one row per sequence slot, a per-row
       walk over chunks, as in a decode bucket;
    2. chunked continuations and prefix hits (sequences of two or more tokens with pool context):
       one loop over (sequence, tile of XLA_POOL_TILE of its tokens, chunk of XLA_SEQ_CHUNK_BLOCKS
       blocks of its context) triples. Each iteration gathers that one chunk of K/V and scores the
       tile against it with a plain matmul.

    Fresh prompts and padding tokens take neither part. Each token sees the pool positions in
    [first_visible, limit); a sequence's walk starts at the chunk of its first token's first visible
    position (a sliding window's start). Returns (denominator, accumulator)."""
    t = qf.shape[0]
    s = tables.shape[0]
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    first_tok = jnp.clip(cu_q_lens[:-1], 0, t - 1)
    seq_limit = jnp.where(q_len > 0, limit[first_tok], 0)  # [S] pool context of each sequence

    # 1. Decode rows: the per-row walk of a decode bucket, over one row per sequence slot. Their
    # running max is not written back: nothing after this reads it for those tokens.
    row = (q_len == 1) & (seq_limit > 0)
    row_out = _pool_walk(qf[first_tok], jnp.arange(s), first_visible[first_tok], jnp.where(row, seq_limit, 0),
                         tuple(x[first_tok] for x in init), tables=tables, k_pool=k_pool, v_pool=v_pool,
                         chunk_blocks=chunk_blocks, block_size=block_size, dense=False, softcap=softcap)
    dest = jnp.where(row, first_tok, t)  # other slots write nothing (dropped out of bounds)
    state = (init[0],) + tuple(x.at[dest].set(r, mode="drop") for x, r in zip(init[1:], row_out))

    # 2. Multi-token sequences with pool context.
    tile = min(XLA_POOL_TILE, t)
    c2 = min(XLA_SEQ_CHUNK_BLOCKS, tables.shape[1])
    tables2 = jnp.pad(tables, ((0, 0), (0, (-tables.shape[1]) % c2)))
    c2_tokens = c2 * block_size
    multi = (q_len >= 2) & (seq_limit > 0)
    c0 = jnp.minimum(first_visible[first_tok] // c2_tokens, (seq_limit + c2_tokens - 1) // c2_tokens)  # [S] first chunk
    n_chunks = (seq_limit + c2_tokens - 1) // c2_tokens - c0
    iters = jnp.where(multi, ((q_len + tile - 1) // tile) * n_chunks, 0)
    ends = jnp.cumsum(iters)
    num_kv_heads, n_rep, head_dim = qf.shape[1:]

    # The loop runs with the kv head as the leading axis ([kvh, T, rep, ...]): its score and value
    # matmuls are then batched over a leading axis, which XLA:CPU runs 2-3x faster than a batch
    # over a non-leading one, and the head axis stays whole for tensor parallelism to shard.
    head_major = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731  [T, kvh, ...] <-> [kvh, T, ...]
    qg = head_major(qf)

    def body(k, state):
        sq = jnp.minimum(jnp.searchsorted(ends, k, side="right"), s - 1)
        local = k - (ends[sq] - iters[sq])
        nc = jnp.maximum(n_chunks[sq], 1)
        j, i = local // nc, c0[sq] + local % nc
        lo = cu_q_lens[sq] + j * tile  # the tile's first token
        win = jnp.clip(lo, 0, t - tile)
        tok = win + jnp.arange(tile)
        mine = (tok >= lo) & (tok < jnp.minimum(lo + tile, cu_q_lens[sq + 1]))
        cols = jax.lax.dynamic_slice_in_dim(tables2[sq], i * c2, c2)
        kc = jnp.take(k_pool, cols, axis=0, mode="clip").reshape(c2_tokens, num_kv_heads, head_dim)
        vc = jnp.take(v_pool, cols, axis=0, mode="clip").reshape(c2_tokens, num_kv_heads, head_dim)
        kpos = i * c2_tokens + jnp.arange(c2_tokens)
        visible = (mine[:, None] & (kpos[None, :] < seq_limit[sq])
                   & (kpos[None, :] >= first_visible[tok][:, None]))  # [tile, chunk]
        q = jax.lax.dynamic_slice_in_dim(qg, win, tile, axis=1).reshape(num_kv_heads, tile * n_rep, head_dim)
        old = tuple(jax.lax.dynamic_slice_in_dim(x, win, tile, axis=1) for x in state)
        sc = jnp.einsum("gqd,gld->gql", q, _f32(head_major(kc)))
        sc = softcap_scores(sc.reshape(num_kv_heads, tile, n_rep, c2_tokens), softcap)
        new = _merge(old, sc, visible[None, :, None, :], head_major(vc), "gtrl,gld->gtrd")
        keep = lambda a, b: jnp.where(mine.reshape((1, tile) + (1,) * (a.ndim - 2)), a, b)  # noqa: E731
        return tuple(jax.lax.dynamic_update_slice_in_dim(x, keep(a, b), win, axis=1)
                     for x, a, b in zip(state, new, old))

    state = jax.lax.fori_loop(0, ends[-1], body, tuple(head_major(x) for x in state))
    return tuple(head_major(x) for x in state[1:])


def _self_attention(qf, k_new, v_new, seq, pos, window=None, softcap=None):
    """The online-softmax state (max, denominator, accumulator) of every token attending over this
    step's tokens of its own sequence up to itself: [T * rep, T] score blocks per kv head, the head
    the leading batch axis (as in _split_walk).

    Tokens are packed in order, so a token sees only tokens at or before its own index. Past
    SELF_TILE tokens the queries go in static tiles of SELF_TILE, each scored against the keys up
    to its own end: the blocks above the diagonal, which the mask would throw away, are never
    computed (for 512 tokens, 10 of 16 tile-blocks' work instead of all 16)."""
    t, num_kv_heads, n_rep, head_dim = qf.shape
    qg = jnp.moveaxis(qf, 1, 0)  # [kvh, T, rep, d]
    kg, vg = (_f32(jnp.moveaxis(x, 1, 0)) for x in (k_new, v_new))  # [kvh, T, d]
    valid = pos >= 0
    parts = []
    for lo in range(0, t, SELF_TILE):
        hi = min(lo + SELF_TILE, t)  # queries [lo, hi) against keys [0, hi)
        q = qg[:, lo:hi].reshape(num_kv_heads, (hi - lo) * n_rep, head_dim)
        sc = jnp.einsum("gqd,gud->gqu", q, kg[:, :hi]).reshape(num_kv_heads, hi - lo, n_rep, hi)
        sc = softcap_scores(sc, softcap)
        visible = ((seq[lo:hi, None] == seq[None, :hi]) & visible_pos(pos[None, :hi], pos[lo:hi, None], window)
                   & valid[None, :hi] & valid[lo:hi, None])
        sc = jnp.where(visible[None, :, None, :], sc, -jnp.inf)
        mx = jnp.maximum(jnp.max(sc, axis=-1), -1e30)
        p = jnp.exp(sc - mx[..., None])
        acc = jnp.einsum("gtru,gud->gtrd", p, vg[:, :hi])
        parts.append((mx, jnp.sum(p, axis=-1), acc))
    return tuple(jnp.moveaxis(jnp.concatenate(x, axis=1), 0, 1) for x in zip(*parts))


def _contiguous_as_paged(k_cache, v_cache, seq_ids, positions, block_size: int):
    """Views [S, L, h, d] caches as pools with identity block tables, for the paged kernels.

    Tokens must be grouped by sequence in ascending seq id (the engine packs them that way).
    """
    s, l = k_cache.shape[:2]
    bs = block_size if l % block_size == 0 else l
    pools = [c.reshape((s * l // bs, bs) + c.shape[2:]) for c in (k_cache, v_cache)]
    tables = jnp.arange(s * l // bs, dtype=jnp.int32).reshape(s, l // bs)
    counts = jnp.zeros(s + 1, jnp.int32).at[jnp.clip(seq_ids, 0, s) + 1].add(1)
    cu = jnp.cumsum(counts)[: s + 1].astype(jnp.int32)
    ctx = jnp.zeros(s, jnp.int32).at[seq_ids].max(positions + 1, mode="drop")
    return pools[0], pools[1], tables, ctx, cu, bs


def matmul_int8_cpp(x, w, scale, *, activations=None, layer=None):
    """matmul_int8 under kernel_backend="cpp": a product of few rows in our C++ kernels, W8A8 (the
    same int32 sums as XLA's dot, so the same result) or weight-only with f32 activations (f32 sums
    in another order); anything else as ir.ops lowers it.

    With `layer` (a scanned step's traced layer index; see layer_indexed_inputs), w is the stack
    [L, K, N] of every layer's weight: the kernels read layer `layer` where it lies, and only XLA's
    products take the slice (a copy)."""
    rows = math.prod(x.shape[:-1])
    if cpp_kernels.matmul_vectorized():
        if activations == INT8_ACTIVATIONS and rows <= CPP_INT8_MAX_ROWS:
            return w8a8_matmul(x, w, scale, product=functools.partial(cpp_kernels.int8_matmul, layer=layer))
        if activations is None and x.dtype == jnp.float32 and rows <= CPP_INT8_WEIGHT_ONLY_MAX_ROWS:
            return weight_only_matmul(x, w, scale,
                                      product=functools.partial(cpp_kernels.int8_weight_matmul, layer=layer))
    if layer is not None:
        w = jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
    return OPS["matmul_int8"].impl(x, w, scale, activations=activations)


def matmul_cpp(x, w, *, transpose_b=False, layer=None):
    """matmul under kernel_backend="cpp": an f32 product of at most CPP_F32_MAX_ROWS rows in our C++
    kernel (f32 sums in another order than XLA's), anything else as ir.ops lowers it. `layer` as in
    matmul_int8_cpp: the kernel reads a scanned step's layer where it lies in the stack [L, K, N]."""
    rows = math.prod(x.shape[:-1])
    if (cpp_kernels.matmul_vectorized() and not transpose_b and x.dtype == jnp.float32 and w.dtype == jnp.float32
            and rows <= CPP_F32_MAX_ROWS):
        y = cpp_kernels.f32_matmul(x.reshape(rows, x.shape[-1]), w, layer=layer)
        return y.reshape(x.shape[:-1] + (w.shape[-1],))
    if layer is not None:
        w = jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
    return matmul_xla(x, w, transpose_b=transpose_b)


def matmul_blocks_cpp(x, *weights, format, max_rows, transpose_b=False, layout="rows", activations="f32",
                      layer=None):
    """matmul_blocks under kernel_backend="cpp": a product of at most `max_rows` rows reads the GGUF
    blocks in our C++ kernel where it has its vector path: the file's rows or tiles with f32
    activations (the same values as w, f32 sums in another order; the file's rows up to the build's
    cpp_kernels.blocks_max_rows() too), or tiles with q8 activations
    (int8 products of the rounded activations, exact int32 sums per block). Anything else
    multiplies by w as matmul_cpp does (the tiles: by their values, ir.blocks.dequantize_tiles),
    after the same rounding for q8. `layer` as in matmul_int8_cpp, for whichever weight arrives as
    a stack [L, ...]."""
    rows = math.prod(x.shape[:-1])
    tiles = layout == "tiles"
    w_blocks = weights[-1]
    limit = cpp_kernels.tiles_max_rows(activations) if tiles else cpp_kernels.blocks_max_rows()
    if rows > min(max_rows, limit) or not (
            cpp_kernels.tiles_vectorized(activations) if tiles else cpp_kernels.blocks_vectorized()):
        if len(weights) == 1:  # the tiles alone: the op's reference, on the layer's tiles
            if layer is not None and w_blocks.ndim == 3:
                w_blocks = jax.lax.dynamic_index_in_dim(w_blocks, layer, keepdims=False)
            return OPS["matmul_blocks"].impl(x, w_blocks, format=format, max_rows=max_rows, layout=layout,
                                             activations=activations)
        x = round_q8(x) if activations == "q8" else x
        w = weights[0]
        return matmul_cpp(x, w, transpose_b=transpose_b, layer=layer if w.ndim == 3 else None)
    layer = layer if w_blocks.ndim == 3 else None
    x2 = x.reshape(rows, x.shape[-1]).astype(jnp.float32)
    if tiles:
        y = cpp_kernels.tile_matmul(x2, w_blocks, format, layer=layer, activations=activations)
    else:
        y = cpp_kernels.block_matmul(x2, w_blocks, format, layer=layer)
    return y.reshape(x.shape[:-1] + (y.shape[-1],)).astype(x.dtype)


# Rows per work item of the CPU grouped matmul (grouped_matmul_tiles): the next power of two of the
# average rows per group, within these bounds. A decode step has a few rows per expert (64 tokens x
# top-4 over 64 experts: 4), a prefill step tens.
GMM_MIN_TILE, GMM_MAX_TILE = 8, 128


def grouped_matmul_tile_rows(num_rows: int, num_groups: int) -> int:
    """Rows per work item of grouped_matmul_tiles for these static shapes."""
    per_group = -(-num_rows // max(1, num_groups))
    return min(GMM_MAX_TILE, max(GMM_MIN_TILE, 1 << max(0, (per_group - 1).bit_length())))


def grouped_matmul_tiles(lhs, rhs, group_sizes, *, cpp: bool = False, layer=None):
    """The grouped matmul on XLA:CPU (grouped_matmul's contract): a loop over (group, tile of rows)
    work items, each a dynamic slice of the sorted rows times its group's matrix, written back
    where its rows are. The work is about M / tile + G products of one tile, growing with the rows,
    not with the groups. XLA:CPU's ragged_dot runs every group on every row instead: on a 64-expert
    top-4 layer at 64 rows (hidden 1024, f32) it took 1.9x the time of all 64 experts run densely,
    this loop 0.18-0.34x (benchmarks/moe_layer.py on a loaded 2-core machine).

    XLA takes each group's matrix as a copy (a dynamic slice) before its product; with `cpp` (f32
    only), our C++ row kernel reads it where it lies in rhs instead (cpp_kernels.f32_matmul with
    the group as its layer). With `layer` (a scanned step's traced layer index), rhs is the stack
    [L, G, K, N] of every layer's experts, viewed as [L * G, K, N]: each tile takes only its own
    expert's matrix of that layer, never a copy of the whole layer's.

    Half-precision experts are widened to f32 per tile (XLA:CPU has no half dot); at the shape
    above in bf16 that made the loop about as slow as the dense layer, where f32 (CPU's default
    dtype) runs it at a fraction."""
    m, n = lhs.shape[0], rhs.shape[-1]
    num_groups = group_sizes.shape[0]
    base = 0
    if layer is not None:
        base = jnp.asarray(layer, jnp.int32) * num_groups
        rhs = rhs.reshape((-1,) + rhs.shape[2:])
    tile = grouped_matmul_tile_rows(m, num_groups)
    ends = jnp.minimum(jnp.cumsum(group_sizes), m)
    offsets = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends])
    tiles = (offsets[1:] - offsets[:-1] + tile - 1) // tile  # work items per group
    item_ends = jnp.cumsum(tiles)
    lhs = jnp.pad(lhs, ((0, tile), (0, 0)))  # every tile's slice in bounds
    half = rhs.dtype in HALF_DTYPES and jax.default_backend() == "cpu"  # no half dot on XLA:CPU

    def body(item, out):
        g = jnp.searchsorted(item_ends, item, side="right").astype(jnp.int32)
        row0 = offsets[g] + (item - (item_ends[g] - tiles[g])) * tile
        x = jax.lax.dynamic_slice_in_dim(lhs, row0, tile)
        if cpp:
            y = cpp_kernels.f32_matmul(x, rhs, layer=base + g)
        else:
            w = jax.lax.dynamic_index_in_dim(rhs, base + g, keepdims=False)
            if half:
                x, w = x.astype(jnp.float32), w.astype(jnp.float32)
            y = jnp.dot(x, w, preferred_element_type=jnp.float32)
        mine = (row0 + jnp.arange(tile) < offsets[g + 1])[:, None]  # the next group's rows: kept
        old = jax.lax.dynamic_slice_in_dim(out, row0, tile)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, old), row0, axis=0)

    out = jax.lax.fori_loop(0, item_ends[-1], body, jnp.zeros((m + tile, n), jnp.float32))
    return out[:m].astype(lhs.dtype)


def grouped_matmul(lhs, rhs, group_sizes, *, backend: str, layer=None):
    """The grouped (mixture-of-experts) product under `backend`: jax.lax.ragged_dot's contract.

    lhs [M, K] holds rows sorted by group; rhs [G, K, N] one matrix per group (expert), of lhs's
    dtype (float32, bfloat16 or float16; anything else is a ValueError); group_sizes int [G], the
    rows of each group, empty groups allowed. Group g's rows are [sum(sizes[:g]),
    sum(sizes[:g+1])); rows past sum(group_sizes) come out as zeros, and a sum past M is clipped
    to M. Returns [M, N] in lhs's dtype, the products accumulated in f32 on every backend.

    Backends: "pallas" runs our Pallas kernel (pallas_kernels.grouped_matmul, GPU), "interpret"
    the same kernel in the Pallas interpreter (tests); "xla" and "cpp" run grouped_matmul_tiles on
    XLA:CPU (the fastest exact form benchmarks/moe_layer.py found there; under "cpp", f32 tiles of
    at most CPP_F32_MAX_ROWS rows in our C++ row kernel) and XLA's ragged_dot on other platforms.

    `layer` as in matmul_int8_cpp: a scanned step's traced layer index, rhs then the stack
    [L, G, K, N]; the CPU tile loop reads each tile's expert of that layer from the stack (in place
    under "cpp"), the other paths take the layer's slice (a copy)."""
    import pallas_kernels as pk

    if layer is not None and rhs.ndim != 4:
        raise ValueError(f"grouped_matmul: a layer index needs rhs [L, G, K, N], got {rhs.shape}")
    one_layer = rhs if layer is None else jax.ShapeDtypeStruct(rhs.shape[1:], rhs.dtype)
    pk.grouped_matmul_check_inputs(lhs, one_layer, group_sizes)
    group_sizes = group_sizes.astype(jnp.int32)
    if backend not in ("pallas", "interpret", "xla", "cpp"):
        raise ValueError(f"grouped_matmul: unknown kernel backend {backend!r}")
    if backend in ("xla", "cpp") and jax.default_backend() == "cpu":
        cpp = (backend == "cpp" and lhs.dtype == jnp.float32 and cpp_kernels.matmul_vectorized()
               and grouped_matmul_tile_rows(lhs.shape[0], group_sizes.shape[0]) <= CPP_F32_MAX_ROWS)
        return grouped_matmul_tiles(lhs, rhs, group_sizes, cpp=cpp, layer=layer)
    if layer is not None:
        rhs = jax.lax.dynamic_index_in_dim(rhs, layer, keepdims=False)
    if backend in ("pallas", "interpret"):
        return pk.grouped_matmul(lhs, rhs, group_sizes, interpret=backend == "interpret")
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def layer_indexed_inputs(backend: str) -> dict[str, tuple[int, ...]]:
    """op name -> the inputs that `backend`'s lowering of the op can take as a whole layer stack
    [L, ...] plus a `layer` attr, in a step scanned over layers (runtime/worker/executor.py): the
    weights of matmul, matmul_int8 and matmul_blocks under "cpp", which its kernels read in place."""
    return {"matmul": (1,), "matmul_int8": (1,), "matmul_blocks": (1, 2)} if backend == "cpp" else {}


def lowerings(backend: str) -> dict:
    """op name -> implementation for the given backend (`xla`, `cpp`, `pallas` or `interpret`)."""
    if backend == "cpp":
        return {"paged_attention": functools.partial(paged_attention_xla, row_kernel=True),
                "kv_write": kv_write_xla, "matmul": matmul_cpp, "matmul_int8": matmul_int8_cpp,
                "matmul_blocks": matmul_blocks_cpp}
    if backend == "xla":
        return {"paged_attention": functools.partial(paged_attention_xla, row_kernel=False), "kv_write": kv_write_xla,
                "matmul": matmul_xla}
    import pallas_kernels as pk

    interpret = backend == "interpret"

    def paged(q, k_pool, v_pool, block_tables, context_lens, cu_q_lens, *, scale, num_kv_heads,
              block_size, head_dim, window=None, softcap=None):
        # One kernel call, tiled per bucket at trace time; no run-time branch. A conditional
        # would take the pools as operands, and XLA may copy a conditional's operands; the pools
        # must reach the kernel as the donated buffers themselves.
        #   decode-shaped buckets (no more tokens than sequences): one query token per work item,
        #     so a decode row wastes no tile rows;
        #   prefill-shaped buckets: tiles of several tokens of one sequence, so each KV page is
        #     read once per tile rather than once per token.
        #   a KV cache narrower than the model (kv_cache_dtype=bfloat16 on an f32 plan): q goes to
        #     the kernel in the pools' dtype; its products accumulate in f32 all the same.
        t, s = q.shape[0], context_lens.shape[0]
        blocks = pk.PagedAttentionBlockSizes(block_q=1) if t <= s else None
        out = pk.paged_attention(q.astype(k_pool.dtype), k_pool, v_pool, block_tables, context_lens, cu_q_lens,
                                 sm_scale=scale, block_sizes=blocks, interpret=interpret, window=window,
                                 softcap=softcap)
        return out.astype(q.dtype)

    def attention(q, k_cache, v_cache, seq_ids, positions, *, scale, causal, num_kv_heads, head_dim,
                  window=None, softcap=None):
        if not causal:
            raise ValueError("the Pallas attention lowering supports causal attention only")
        kp, vp, tables, ctx, cu, _ = _contiguous_as_paged(k_cache, v_cache, seq_ids, positions, 16)
        return pk.paged_attention(q, kp, vp, tables, ctx, cu, sm_scale=scale, interpret=interpret,
                                  window=window, softcap=softcap)

    return {"paged_attention": paged, "attention": attention}
