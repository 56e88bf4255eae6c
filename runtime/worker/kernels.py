"""Backend lowerings of the attention ops: a blocked XLA loop on CPU, our Pallas kernels on GPU.

The jnp references in `ir.ops` gather the whole context of every token at once, which is
clear but sized by max_model_len. The XLA lowering here walks the context in chunks of
blocks with an online softmax, stopping at the longest context in the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from passes.plan_memory import (XLA_CHUNK_BLOCKS, XLA_DENSE_MAX_SEQS,  # the tiling the memory plan sizes
                                XLA_POOL_TILE, uses_new_kv)


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
                        k_new=None, v_new=None):
    """Ragged paged attention as an XLA while-loop over context chunks (online softmax, f32).

    With `k_new`/`v_new` (this step's K/V [T, kv_heads, d], already written to the pools) in a
    prefill-shaped bucket: the step's tokens first attend over each other (block-diagonal causal),
    and the loop then covers only the context written by earlier steps (prefix hits, earlier
    chunks), merged into the same online softmax. That walk goes over tiles of XLA_POOL_TILE
    tokens, up to the last token with such context: in a step that mixes decode rows with a fresh
    prompt, only the decode rows' tile gathers K/V, not every prompt token."""
    t = q.shape[0]
    s, m = block_tables.shape
    c = min(chunk_blocks, m)
    pad = (-m) % c
    tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
    n_rep = q.shape[1] // num_kv_heads
    seq, pos = _token_layout(cu_q_lens, context_lens, t)
    qf = q.astype(jnp.float32).reshape(t, num_kv_heads, n_rep, head_dim) * scale
    walk = functools.partial(_pool_walk, tables=tables, k_pool=k_pool, v_pool=v_pool, chunk_blocks=c,
                             block_size=block_size, dense=s <= XLA_DENSE_MAX_SEQS and t > s)
    if k_new is not None and uses_new_kv(t, s):
        mx, den, acc = _self_attention(qf, k_new, v_new, seq, pos)
        start = context_lens - (cu_q_lens[1:] - cu_q_lens[:-1])  # [S] this step's first position
        limit = jnp.where(pos >= 0, start[seq], 0)  # pool context visible to each token: < limit
        if not walk.keywords["dense"]:
            den, acc = _tiled_walk(walk, qf, seq, limit, (mx, den, acc))
        else:
            den, acc = walk(qf, seq, limit, (mx, den, acc))
    else:
        init = (jnp.full((t, num_kv_heads, n_rep), -1e30, jnp.float32),
                jnp.zeros((t, num_kv_heads, n_rep), jnp.float32),
                jnp.zeros((t, num_kv_heads, n_rep, head_dim), jnp.float32))
        den, acc = walk(qf, seq, pos + 1, init)
    out = jnp.where(den[..., None] > 0, acc / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    return out.reshape(q.shape).astype(q.dtype)


def _pool_walk(qf, seq, limit, init, *, tables, k_pool, v_pool, chunk_blocks, block_size, dense):
    """Online softmax of tokens `qf` [T, kvh, rep, d] (of sequences `seq`) over the pool positions
    below `limit` [T], merged into `init` (max, denominator, accumulator); a fori_loop over chunks
    of `chunk_blocks` blocks up to the largest limit. Returns (denominator, accumulator)."""
    chunk = functools.partial(_chunk_update, tables=tables, k_pool=k_pool, v_pool=v_pool,
                              chunk_blocks=chunk_blocks, block_size=block_size, dense=dense)
    chunk_tokens = chunk_blocks * block_size
    num_chunks = (jnp.max(limit) + chunk_tokens - 1) // chunk_tokens
    return jax.lax.fori_loop(0, num_chunks, lambda i, carry: chunk(i, qf, seq, limit, carry), init)[1:]


def _chunk_update(i, qf, seq, limit, carry, *, tables, k_pool, v_pool, chunk_blocks, block_size, dense):
    """The online-softmax state `carry` (max, denominator, accumulator) of tokens `qf`, after chunk
    `i` of their sequences' pool context (positions below `limit`)."""
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
        sc = jnp.einsum("tgrd,mgd->tgrm", qf, k.astype(jnp.float32))
        same_seq = jnp.repeat(jnp.arange(s), chunk_tokens)[None, :] == seq[:, None]
        visible = (same_seq & (jnp.tile(kpos, s)[None, :] < limit[:, None]))[:, None, None, :]
    else:
        blocks = jnp.take(cols, seq, axis=0)  # [T, C]
        k = jnp.take(k_pool, blocks, axis=0, mode="clip").reshape(t, chunk_tokens, num_kv_heads, head_dim)
        v = jnp.take(v_pool, blocks, axis=0, mode="clip").reshape(t, chunk_tokens, num_kv_heads, head_dim)
        sc = jnp.einsum("tgrd,tlgd->tgrl", qf, k.astype(jnp.float32))
        visible = (kpos[None, :] < limit[:, None])[:, None, None, :]
    mx, den, acc = carry
    sc = jnp.where(visible, sc, -jnp.inf)
    new_mx = jnp.maximum(mx, jnp.max(sc, axis=-1))
    p = jnp.exp(sc - new_mx[..., None])
    corr = jnp.exp(mx - new_mx)
    den = den * corr + jnp.sum(p, axis=-1)
    pv = (jnp.einsum("tgrl,lgd->tgrd", p, v.astype(jnp.float32)) if dense
          else jnp.einsum("tgrl,tlgd->tgrd", p, v.astype(jnp.float32)))
    return new_mx, den, acc * corr[..., None] + pv


def _tiled_walk(walk, qf, seq, limit, init):
    """`walk`'s chunks, for tiles of XLA_POOL_TILE tokens from the first token to the last one with
    pool context (limit > 0); tiles past it are skipped. One loop over (tile, chunk) pairs (a
    nested loop compiled ~1.7x slower). Returns (denominator, accumulator) for every token."""
    chunk = functools.partial(_chunk_update, **walk.keywords)
    t = qf.shape[0]
    tile = min(XLA_POOL_TILE, t)
    pad = (-t) % tile
    padded = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    qf, seq, limit = padded(qf), padded(seq), padded(limit)
    state = tuple(padded(x) for x in init)
    last = jnp.max(jnp.where(limit > 0, jnp.arange(t + pad), -1)) + 1  # tokens up to the last with context
    chunk_tokens = walk.keywords["chunk_blocks"] * walk.keywords["block_size"]
    num_chunks = (jnp.max(limit) + chunk_tokens - 1) // chunk_tokens
    num_tiles = (last + tile - 1) // tile

    def body(k, state):
        j, i = k // num_chunks, k % num_chunks
        at = lambda x: jax.lax.dynamic_slice_in_dim(x, j * tile, tile, axis=0)  # noqa: E731
        part = chunk(i, at(qf), at(seq), at(limit), tuple(at(x) for x in state))
        return tuple(jax.lax.dynamic_update_slice_in_dim(x, p, j * tile, axis=0) for x, p in zip(state, part))

    state = jax.lax.fori_loop(0, num_tiles * num_chunks, body, state)
    return tuple(x[:t] for x in state[1:])


def _self_attention(qf, k_new, v_new, seq, pos):
    """The online-softmax state (max, denominator, accumulator) of every token attending over this
    step's tokens of its own sequence up to itself: one [T, kvh, rep, T] score block."""
    sc = jnp.einsum("tgrd,ugd->tgru", qf, k_new.astype(jnp.float32))
    valid = pos >= 0
    visible = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None]) & valid[None, :] & valid[:, None]
    sc = jnp.where(visible[:, None, None, :], sc, -jnp.inf)
    mx = jnp.maximum(jnp.max(sc, axis=-1), -1e30)
    p = jnp.exp(sc - mx[..., None])
    return mx, jnp.sum(p, axis=-1), jnp.einsum("tgru,ugd->tgrd", p, v_new.astype(jnp.float32))


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


def lowerings(backend: str) -> dict:
    """op name -> implementation for the given backend (`xla`, `pallas` or `interpret`)."""
    if backend == "xla":
        return {"paged_attention": paged_attention_xla}
    import pallas_kernels as pk

    interpret = backend == "interpret"

    def paged(q, k_pool, v_pool, block_tables, context_lens, cu_q_lens, *, scale, num_kv_heads,
              block_size, head_dim):
        # One kernel call, tiled per bucket at trace time; no run-time branch. A conditional
        # would take the pools as operands, and XLA may copy a conditional's operands; the pools
        # must reach the kernel as the donated buffers themselves.
        #   decode-shaped buckets (no more tokens than sequences): one query token per work item,
        #     so a decode row wastes no tile rows;
        #   prefill-shaped buckets: tiles of several tokens of one sequence, so each KV page is
        #     read once per tile rather than once per token.
        t, s = q.shape[0], context_lens.shape[0]
        blocks = pk.PagedAttentionBlockSizes(block_q=1) if t <= s else None
        return pk.paged_attention(q, k_pool, v_pool, block_tables, context_lens, cu_q_lens,
                                  sm_scale=scale, block_sizes=blocks, interpret=interpret)

    def attention(q, k_cache, v_cache, seq_ids, positions, *, scale, causal, num_kv_heads, head_dim):
        if not causal:
            raise ValueError("the Pallas attention lowering supports causal attention only")
        kp, vp, tables, ctx, cu, _ = _contiguous_as_paged(k_cache, v_cache, seq_ids, positions, 16)
        return pk.paged_attention(q, kp, vp, tables, ctx, cu, sm_scale=scale, interpret=interpret)

    return {"paged_attention": paged, "attention": attention}
