"""The attention ops of the op table: textbook attention over a contiguous cache, its fused form,
and the paged KV ops, with their shape rules and jnp references.

Two optional attributes shape which keys a query sees and how it scores them, on `causal_mask`,
`attention` and `paged_attention` alike:
    window=W    sliding-window attention: the query at position p sees keys p - W < k <= p (W keys,
                itself included; HF's `kv_idx > q_idx - sliding_window`). Absent: every key <= p.
    softcap=C   scores (after the scale) pass through C * tanh(s / C) before the mask (Gemma 2).
`visible` and `softcap_scores` below are those rules, which every lowering of the ops follows.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from ir.graph import Dim
from ir.ops import _elementwise_f32, _float, _int_idx, _need, _rank, _same_dim, impl, op

# The optional attributes of the attention ops (module docstring).
WINDOW, SOFTCAP = "window", "softcap"


def visible(key_pos, pos, window=None):
    """Which keys a query at `pos` attends to (broadcasting): causal, and inside its window."""
    keep = key_pos <= pos
    if window is not None:
        keep &= key_pos > pos - window
    return keep


def softcap_scores(s, softcap=None):
    """Gemma 2's logit softcapping, C * tanh(s / C); the identity without a cap."""
    return s if softcap is None else jnp.tanh(s / softcap) * softcap


def _check_window_softcap(attrs, what: str) -> None:
    w, c = attrs.get(WINDOW), attrs.get(SOFTCAP)
    _need(w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 1),
          f"{what} window must be a positive int, got {w!r}")
    _need(c is None or (isinstance(c, int | float) and not isinstance(c, bool) and c > 0),
          f"{what} softcap must be a positive number, got {c!r}")


# ---------------------------------------------------------------------------- textbook attention

@op("kv_cache_update", 4)
def _kv_cache_update(inputs, attrs):
    cache, new, seq_ids, pos = inputs
    _rank(cache, 4, "contiguous kv cache [S, L, kv_heads, head_dim]")
    _rank(new, 3, "new kv [T, kv_heads, head_dim]")
    _same_dim(cache.shape[2], new.shape[1], "kv_cache_update kv_heads must agree")
    _same_dim(cache.shape[3], new.shape[2], "kv_cache_update head_dim must agree")
    _int_idx(seq_ids, "kv_cache_update seq_ids")
    _int_idx(pos, "kv_cache_update positions")
    _need(cache.dtype == new.dtype, f"kv_cache_update dtypes must agree: {cache.dtype} vs {new.dtype}")
    return cache.shape, cache.dtype


@impl("kv_cache_update")
def _kv_cache_update_impl(cache, new, seq_ids, pos):
    # Padding tokens carry seq_id == S (out of range) and are dropped.
    return cache.at[seq_ids, pos].set(new, mode="drop")


@op("repeat_kv", 1, ("n_rep",))
def _repeat_kv(inputs, attrs):
    (x,) = inputs
    _need(len(x.shape) >= 2, "repeat_kv needs [..., kv_heads, head_dim]")
    h = x.shape[-2]
    _need(isinstance(h, int), "repeat_kv needs a concrete head count")
    return tuple(x.shape[:-2]) + (h * attrs["n_rep"], x.shape[-1]), x.dtype


@impl("repeat_kv")
def _repeat_kv_impl(x, *, n_rep):
    # q head j reads kv head j // n_rep, as HF's repeat_kv does.
    return jnp.repeat(x, n_rep, axis=-2)


_EINSUM = re.compile(r"^([a-z]+),([a-z]+)->([a-z]+)$")


@op("einsum", 2, ("eq",))
def _einsum(inputs, attrs):
    a, b = inputs
    m = _EINSUM.match(attrs["eq"])
    _need(m is not None, f"einsum equation {attrs['eq']!r} must look like 'ab,bc->ac'")
    sa, sb, so = m.groups()
    _need(len(sa) == len(a.shape) and len(sb) == len(b.shape),
          f"einsum {attrs['eq']!r} does not fit operand ranks {len(a.shape)} and {len(b.shape)}")
    sizes: dict[str, Dim] = {}
    for letters, shape in ((sa, a.shape), (sb, b.shape)):
        for ch, d in zip(letters, shape):
            _need(sizes.setdefault(ch, d) == d, f"einsum {attrs['eq']!r}: dim {ch!r} is {sizes[ch]} and {d}")
    _need(all(ch in sizes for ch in so), f"einsum {attrs['eq']!r}: output letter not in inputs")
    return tuple(sizes[ch] for ch in so), a.dtype


@impl("einsum")
def _einsum_impl(a, b, *, eq):
    return jnp.einsum(eq, a, b.astype(a.dtype), preferred_element_type=jnp.float32).astype(a.dtype)


@op("causal_mask", 2)
def _causal_mask(inputs, attrs):
    s, pos = inputs
    _rank(s, 3, "causal_mask scores [T, heads, L]")
    _same_dim(s.shape[0], pos.shape[0], "causal_mask needs one position per token")
    _int_idx(pos, "causal_mask positions")
    _check_window_softcap(attrs, "causal_mask")
    _need(SOFTCAP not in attrs, "causal_mask takes no softcap (the softcap op comes before it)")
    return s.shape, s.dtype


@impl("causal_mask")
def _causal_mask_impl(s, pos, *, window=None):
    # Token t of a sequence sees cache slots 0..pos[t] (the last `window` of them with a window);
    # slots of other sequences are never gathered, so this one mask is both the causal and the
    # varlen mask.
    keep = visible(jnp.arange(s.shape[-1])[None, None, :], pos[:, None, None], window)
    return jnp.where(keep, s, jnp.asarray(-jnp.inf, s.dtype))


_elementwise_f32("softmax", lambda x: jax.nn.softmax(x, axis=-1))


@op("attention", 5, ("scale", "causal", "num_kv_heads", "head_dim"))
def _attention(inputs, attrs):
    q, kc, vc, seq_ids, pos = inputs
    _rank(q, 3, "attention q [T, q_heads, head_dim]")
    _rank(kc, 4, "attention k cache [S, L, kv_heads, head_dim]")
    _need(tuple(kc.shape) == tuple(vc.shape), "attention k and v caches must have one shape")
    _same_dim(kc.shape[2], attrs["num_kv_heads"], "attention num_kv_heads attr must match the cache")
    _same_dim(q.shape[2], attrs["head_dim"], "attention head_dim attr must match q")
    _need(isinstance(q.shape[1], int) and q.shape[1] % attrs["num_kv_heads"] == 0,
          "attention q heads must be a multiple of num_kv_heads")
    _int_idx(seq_ids, "attention seq_ids")
    _int_idx(pos, "attention positions")
    _check_window_softcap(attrs, "attention")
    _need(attrs["causal"] or WINDOW not in attrs, "attention with a window must be causal")
    return q.shape, q.dtype


@impl("attention")
def attention_reference(q, k_cache, v_cache, seq_ids, pos, *, scale, causal, num_kv_heads, head_dim,
                        window=None, softcap=None):
    """Ragged attention over a contiguous per-sequence cache, accumulating in f32."""
    n_rep = q.shape[1] // num_kv_heads
    k = jnp.take(k_cache, seq_ids, axis=0, mode="clip").astype(jnp.float32)  # [T, L, kvh, D]
    v = jnp.take(v_cache, seq_ids, axis=0, mode="clip").astype(jnp.float32)
    qf = q.astype(jnp.float32).reshape(q.shape[0], num_kv_heads, n_rep, head_dim)
    s = softcap_scores(jnp.einsum("tgrd,tlgd->tgrl", qf, k) * scale, softcap)
    if causal:
        keep = visible(jnp.arange(k.shape[1])[None, None, None, :], pos[:, None, None, None], window)
        s = jnp.where(keep, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("tgrl,tlgd->tgrd", p, v)
    return o.reshape(q.shape).astype(q.dtype)


# ---------------------------------------------------------------------------- paged KV

@op("kv_write", 3)
def _kv_write(inputs, attrs):
    pool, new, slots = inputs
    _rank(pool, 4, "kv pool [B, block_size, kv_heads, head_dim]")
    _rank(new, 3, "new kv [T, kv_heads, head_dim]")
    _same_dim(pool.shape[2], new.shape[1], "kv_write kv_heads must agree")
    _same_dim(pool.shape[3], new.shape[2], "kv_write head_dim must agree")
    _same_dim(new.shape[0], slots.shape[0], "kv_write needs one slot per token")
    _int_idx(slots, "kv_write slot_mapping")
    # The pool may be narrower than the new K/V (a bf16 KV cache of an f32 model): written rounded.
    _need(_float(pool.dtype) and _float(new.dtype), f"kv_write needs floating point pool and K/V, got "
          f"{pool.dtype} and {new.dtype}")
    return pool.shape, pool.dtype


@impl("kv_write")
def kv_write_reference(pool, new, slots):
    # slot = block * block_size + offset; padding tokens carry slot -1 and are dropped.
    nb, bs = pool.shape[0], pool.shape[1]
    slots = jnp.where(slots < 0, nb * bs, slots)
    return pool.at[slots // bs, slots % bs].set(new.astype(pool.dtype), mode="drop")


@op("paged_attention", 6, ("scale", "num_kv_heads", "block_size", "head_dim"))
def _paged_attention(inputs, attrs):
    q, kp, vp, tables, ctx, cu = inputs
    _rank(q, 3, "paged_attention q [T, q_heads, head_dim]")
    _rank(kp, 4, "paged_attention k pool [B, block_size, kv_heads, head_dim]")
    _need(tuple(kp.shape) == tuple(vp.shape), "paged_attention k and v pools must have one shape")
    _same_dim(kp.shape[1], attrs["block_size"], "paged_attention block_size attr must match the pool")
    _same_dim(kp.shape[2], attrs["num_kv_heads"], "paged_attention num_kv_heads attr must match the pool")
    _same_dim(q.shape[2], attrs["head_dim"], "paged_attention head_dim attr must match q")
    _rank(tables, 2, "paged_attention block_tables [S, M]")
    _rank(ctx, 1, "paged_attention context_lens [S]")
    _same_dim(tables.shape[0], ctx.shape[0], "block_tables and context_lens need one row per sequence")
    for n, what in ((tables, "block_tables"), (ctx, "context_lens"), (cu, "cu_q_lens")):
        _int_idx(n, f"paged_attention {what}")
    _check_window_softcap(attrs, "paged_attention")
    return q.shape, q.dtype


@impl("paged_attention")
def paged_attention_reference(q, k_pool, v_pool, block_tables, context_lens, cu_q_lens, *, scale,
                              num_kv_heads, block_size, head_dim, window=None, softcap=None):
    """The op's jnp reference: gather each token's sequence blocks, mask, softmax in f32.

    The executor's chunked lowering is runtime.worker.kernels.paged_attention_xla; the Pallas kernel's
    own reference is pallas_kernels.paged_attention_reference.
    """
    t = q.shape[0]
    s, m = block_tables.shape
    n_rep = q.shape[1] // num_kv_heads
    tok = jnp.arange(t)
    # Sequence of each token from the ragged query offsets; padding tokens get seq s (clipped).
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, s - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = context_lens[seq] - q_len + (tok - cu_q_lens[seq])
    blocks = jnp.take(block_tables, seq, axis=0)  # [T, M]
    k = jnp.take(k_pool, blocks, axis=0, mode="clip").reshape(t, m * block_size, num_kv_heads, head_dim)
    v = jnp.take(v_pool, blocks, axis=0, mode="clip").reshape(t, m * block_size, num_kv_heads, head_dim)
    qf = q.astype(jnp.float32).reshape(t, num_kv_heads, n_rep, head_dim)
    sc = softcap_scores(jnp.einsum("tgrd,tlgd->tgrl", qf, k.astype(jnp.float32)) * scale, softcap)
    # With a window, table entries for blocks wholly behind it may hold any block (a window-aware
    # cache frees them): they are masked like every other invisible slot.
    keep = visible(jnp.arange(m * block_size)[None, None, None, :], pos[:, None, None, None], window)
    sc = jnp.where(keep, sc, -jnp.inf)
    # Padding tokens may have no visible slot; keep them finite rather than NaN.
    sc = jnp.where(jnp.any(keep, axis=-1, keepdims=True), sc, 0.0)
    p = jax.nn.softmax(sc, axis=-1)
    o = jnp.einsum("tgrl,tlgd->tgrd", p, v.astype(jnp.float32))
    return o.reshape(q.shape).astype(q.dtype)


@op("copy_blocks", 3)
def _copy_blocks(inputs, attrs):
    pool, src, dst = inputs
    _rank(pool, 4, "copy_blocks pool")
    _int_idx(src, "copy_blocks src")
    _int_idx(dst, "copy_blocks dst")
    return pool.shape, pool.dtype


@impl("copy_blocks")
def _copy_blocks_impl(pool, src, dst):
    # Copy-on-write for n > 1: dst[i] <- src[i]; pairs with dst == -1 are padding.
    dst = jnp.where(dst < 0, pool.shape[0], dst)
    return pool.at[dst].set(jnp.take(pool, src, axis=0, mode="clip"), mode="drop")


