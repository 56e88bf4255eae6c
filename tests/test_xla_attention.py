"""The XLA lowering of paged_attention (runtime.worker.kernels.paged_attention_xla) against the op's
jnp reference on random inputs: ragged query lengths off block boundaries, prefix context from
earlier steps, padding tokens and empty sequence slots, in the few-sequence (dense), per-token and
per-sequence forms, with and without the step's own new K/V (the prefill path that reads no KV back)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ir.attention_ops import paged_attention_reference
from pallas_kernels.testing import cu_from_lens, random_paged_cache
from ir.tiling import XLA_POOL_TILE, XLA_ROW_GROUP, uses_new_kv
from runtime.worker.kernels import SELF_TILE, paged_attention_xla
from tolerances import KERNEL

BS, KVH, QH, D = 16, 2, 6, 32


def _case(rng, q_lens, prior, num_tokens, num_seqs):
    """A step of `num_tokens` tokens / `num_seqs` sequence slots: sequence i has prior[i] tokens of
    context from earlier steps and q_lens[i] new ones (whose K/V this step wrote into the pool)."""
    ctx = np.asarray(q_lens) + np.asarray(prior)
    ctx_all = np.zeros(num_seqs, np.int32)
    ctx_all[:len(ctx)] = ctx
    k_pool, v_pool, tables, _ = random_paged_cache(rng, ctx_all, block_size=BS, num_kv_heads=KVH, head_dim=D,
                                                   dtype=jnp.float32, poison=False)
    k_pool, v_pool = np.asarray(k_pool), np.asarray(v_pool)
    cu = cu_from_lens(list(q_lens) + [0] * (num_seqs - len(q_lens)))
    n = int(cu[-1])
    q = rng.standard_normal((num_tokens, QH, D)).astype(np.float32)
    # This step's K/V: the values at the new positions of each sequence's blocks.
    k_new = np.zeros((num_tokens, KVH, D), np.float32)
    v_new = np.zeros((num_tokens, KVH, D), np.float32)
    tab = np.asarray(tables)
    for s, (ql, pr) in enumerate(zip(q_lens, prior)):
        for j in range(ql):
            p = pr + j
            blk, off = tab[s, p // BS], p % BS
            k_new[cu[s] + j], v_new[cu[s] + j] = k_pool[blk, off], v_pool[blk, off]
    assert n <= num_tokens
    return (jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), tables, jnp.asarray(ctx_all),
            jnp.asarray(cu), jnp.asarray(k_new), jnp.asarray(v_new), n)


CASES = [  # (q_lens, prior, bucket tokens, bucket seqs)
    ([37], [0], 64, 4),                        # one fresh prompt, off block boundaries, padded
    ([5, 17, 1], [0, 0, 0], 32, 4),            # several fresh prompts (dense form)
    ([20, 3], [45, 130], 32, 4),               # chunked continuations over earlier context
    ([9, 1, 1, 12, 7, 1], [0, 33, 70, 16, 0, 5], 40, 8),  # mixed prefill + decode, per-token form
    ([64], [0], 64, 16),                       # a full bucket, no padding
    ([1, 1, 1], [10, 0, 47], 4, 4),            # decode-shaped: the new K/V are not used
    # Past one pool tile (XLA_POOL_TILE tokens): decode rows, a fresh prompt, then a continuation
    # and a decode row in the last tile (off the tile boundary, bucket not a multiple of a tile).
    ([1, 1, 1, 1, 1, 90, 40, 1], [20, 3, 70, 150, 5, 0, 37, 12], 160, 16),
    ([1] * 6 + [120], [9, 30, 2, 17, 64, 100, 0], 128, 16),  # context only in the first tile
    # Per-sequence walk: a one-token fresh prompt beside decode
    # rows, a continuation over 600 tokens (two chunks of XLA_SEQ_CHUNK_BLOCKS) spanning three
    # tiles, and one whose last tile is clamped to the end of the bucket.
    ([1, 1, 130, 1, 70], [40, 0, 600, 17, 33], 256, 16),
    ([3, 61], [100, 700], 64, 8),              # the second sequence's tile starts at token 3
    ([100, 100], [5, 20], 200, 8),             # two continuations; tiles cross between them
    ([1, 50], [300, 1100], 64, 4),             # three context chunks, the last one partial
    # Decode rows walked XLA_ROW_GROUP at a time, longest context first: mixed contexts,
    # padding rows, a row count that is not a multiple of the group, and empty slots.
    ([1] * 13, [0, 300, 17, 5, 129, 128, 640, 1, 33, 256, 90, 400, 2], 16, 16),
    ([1] * 11, [70, 3, 900, 15, 15, 260, 0, 44, 511, 8, 127], 12, 12),
    # Past SELF_TILE tokens the step's own attention goes in query tiles: prompts and a
    # continuation that straddle tile boundaries, a decode row, padding in the last tile.
    ([150, 1, 99, 2, 30], [0, 40, 0, 10, 70], 300, 8),
    # A long prompt over four query tiles, and short prompts packed across tile boundaries
    # (the seqs64 benchmark's prefill steps), padding last.
    ([500], [0], 512, 4),
    ([64] * 7 + [50], [0] * 8, 512, 8),
]


def test_row_group_cases_span_several_groups():
    # The two decode-row cases above must cross a group boundary for the grouped walk to be tested.
    assert 11 > XLA_ROW_GROUP


@pytest.mark.parametrize("q_lens,prior,t,s", CASES)
@pytest.mark.parametrize("with_new_kv", [False, True])
@pytest.mark.parametrize("row_kernel", [False, True], ids=["xla", "cpp"])
def test_xla_lowering_matches_the_reference(q_lens, prior, t, s, with_new_kv, row_kernel):
    """Also with the per-row walks in our C++ kernel (kernel_backend="cpp")."""
    rng = np.random.default_rng(sum(q_lens) * 31 + sum(prior))
    q, kp, vp, tables, ctx, cu, k_new, v_new, n = _case(rng, q_lens, prior, t, s)
    attrs = dict(scale=D ** -0.5, num_kv_heads=KVH, block_size=BS, head_dim=D, row_kernel=row_kernel)
    ref = paged_attention_reference(q, kp, vp, tables, ctx, cu, **{k: v for k, v in attrs.items() if k != "row_kernel"})
    extra = dict(k_new=k_new, v_new=v_new) if with_new_kv else {}
    out = jax.jit(lambda *a: paged_attention_xla(*a, **attrs, **extra))(q, kp, vp, tables, ctx, cu)
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(ref)[:n], **KERNEL[jnp.dtype(jnp.float32)])
    assert np.all(np.isfinite(np.asarray(out)))


def test_self_attention_skips_the_blocks_above_the_diagonal():
    """A 512-token prefill scores each query tile only against the keys up to its own end: the
    score matmuls add up to (1 + 2 + 3 + 4) / 16 of the full [T, T] square, not all of it."""
    t = 4 * SELF_TILE
    q, kp, vp, tables, ctx, cu, k_new, v_new, _ = _case(np.random.default_rng(3), [t - 12], [0], t, 4)
    attrs = dict(scale=D ** -0.5, num_kv_heads=KVH, block_size=BS, head_dim=D, k_new=k_new, v_new=v_new)
    jaxpr = jax.make_jaxpr(lambda *a: paged_attention_xla(*a, **attrs))(q, kp, vp, tables, ctx, cu)
    scores = [e.outvars[0].aval.shape for e in jaxpr.eqns
              if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] % SELF_TILE == 0
              and e.outvars[0].aval.shape[-2] % (SELF_TILE * QH // KVH) == 0]
    assert sorted(s[-1] for s in scores) == [SELF_TILE * i for i in (1, 2, 3, 4)]
    assert all(s[-2] == SELF_TILE * QH // KVH for s in scores)


def test_new_kv_path_reads_no_pool_for_a_fresh_prompt():
    """A fresh prompt's attention comes from its new K/V alone: a pool of NaN gives the same output."""
    rng = np.random.default_rng(7)
    q, kp, vp, tables, ctx, cu, k_new, v_new, n = _case(rng, [37, 11], [0, 0], 64, 4)
    assert uses_new_kv(64, 4)
    attrs = dict(scale=D ** -0.5, num_kv_heads=KVH, block_size=BS, head_dim=D, k_new=k_new, v_new=v_new)
    f = jax.jit(lambda *a: paged_attention_xla(*a, **attrs))
    clean = f(q, kp, vp, tables, ctx, cu)
    nan = f(q, jnp.full_like(kp, jnp.nan), jnp.full_like(vp, jnp.nan), tables, ctx, cu)
    np.testing.assert_array_equal(np.asarray(clean)[:n], np.asarray(nan)[:n])


@pytest.mark.parametrize("row_kernel", [False, True], ids=["xla", "cpp"])
def test_pool_walk_stops_at_the_last_token_with_context(row_kernel):
    """Decode rows, then fresh prompts: the XLA walk over earlier context covers only the tile of
    the decode rows. Pool blocks of a fresh prompt past that tile set to NaN change nothing (a walk
    over every token would gather them: 0 x NaN). The C++ row kernel walks every token's own
    sequence in the pool, the fresh prompt's just-written K/V included: there the NaN changes that
    prompt's tokens only, never another sequence's."""
    rng = np.random.default_rng(11)
    q_lens, prior = [1] * 6 + [58, 120], [9, 30, 2, 17, 64, 100, 0, 0]
    q, kp, vp, tables, ctx, cu, k_new, v_new, n = _case(rng, q_lens, prior, 192, 16)
    assert uses_new_kv(192, 16) and sum(q_lens[:7]) == XLA_POOL_TILE
    attrs = dict(scale=D ** -0.5, num_kv_heads=KVH, block_size=BS, head_dim=D, k_new=k_new, v_new=v_new,
                 row_kernel=row_kernel)
    f = jax.jit(lambda *a: paged_attention_xla(*a, **attrs))
    clean = f(q, kp, vp, tables, ctx, cu)
    fresh_blocks = np.asarray(tables)[7, :-(-120 // BS)]
    kp_nan, vp_nan = (x.at[fresh_blocks].set(jnp.nan) for x in (kp, vp))
    poisoned = f(q, kp_nan, vp_nan, tables, ctx, cu)
    others = n - 120 if row_kernel else n  # the fresh prompt's tokens are last
    np.testing.assert_array_equal(np.asarray(clean)[:others], np.asarray(poisoned)[:others])
    if row_kernel:  # the kernel reads the poisoned K/V (NaN scores: no weight, a zero output)
        assert not np.array_equal(np.asarray(clean)[others:n], np.asarray(poisoned)[others:n])
    ref = paged_attention_reference(q, kp, vp, tables, ctx, cu, scale=D ** -0.5, num_kv_heads=KVH,
                                    block_size=BS, head_dim=D)
    np.testing.assert_allclose(np.asarray(clean)[:n], np.asarray(ref)[:n], **KERNEL[jnp.dtype(jnp.float32)])


# Sliding windows (and Gemma 2's softcap): windows off block boundaries, shorter and longer than a
# chunk of the walk (XLA_CHUNK_BLOCKS blocks), on mixed prefill and decode, a continuation over 600
# tokens, three context chunks, and decode rows in groups.
WINDOW_CASES = [([9, 1, 1, 12, 7, 1], [0, 233, 470, 16, 300, 5], 40, 8)] + [CASES[i] for i in (8, 11, 12)]


def _behind_every_window(tables, ctx, cu, window):
    """(sequence, table column) of the blocks wholly before every window of the sequence's tokens
    in this step: a window-aware cache may have handed them to another sequence."""
    out = []
    for s in range(len(ctx)):
        q_len = int(cu[s + 1] - cu[s])
        if q_len == 0:
            continue
        first = max(int(ctx[s]) - q_len + 1 - window, 0)  # the first token's first visible position
        out += [(s, b) for b in range(first // BS)]
    return out


@pytest.mark.parametrize("q_lens,prior,t,s", WINDOW_CASES)
@pytest.mark.parametrize("window,softcap", [(40, None), (200, 3.0)])
@pytest.mark.parametrize("with_new_kv", [False, True])
@pytest.mark.parametrize("row_kernel", [False, True], ids=["xla", "cpp"])
def test_sliding_window_matches_the_reference(q_lens, prior, t, s, window, softcap, with_new_kv, row_kernel):
    """Each token sees its last `window` positions, scores capped by `softcap`: the lowering equals
    the reference, and the table entries of blocks behind every window of a sequence may name any
    block (the C++ kernel never reads them, even as NaN: it starts at each row's window)."""
    rng = np.random.default_rng(sum(q_lens) * 17 + window)
    q, kp, vp, tables, ctx, cu, k_new, v_new, n = _case(rng, q_lens, prior, t, s)
    q = q * 3.0  # larger scores, so that the softcap bends them
    attrs = dict(scale=D ** -0.5, num_kv_heads=KVH, block_size=BS, head_dim=D, window=window, softcap=softcap)
    ref = paged_attention_reference(q, kp, vp, tables, ctx, cu, **attrs)
    extra = dict(k_new=k_new, v_new=v_new) if with_new_kv else {}
    f = jax.jit(lambda *a: paged_attention_xla(*a, **attrs, **extra, row_kernel=row_kernel))
    out = f(q, kp, vp, tables, ctx, cu)
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(ref)[:n], **KERNEL[jnp.dtype(jnp.float32)])
    behind = _behind_every_window(np.asarray(tables), np.asarray(ctx), np.asarray(cu), window)
    if not behind:
        return
    moved = np.asarray(tables).copy()
    seqs, cols = np.asarray(behind).T
    moved[seqs, cols] = rng.integers(0, kp.shape[0], len(behind))
    np.testing.assert_array_equal(np.asarray(f(q, kp, vp, jnp.asarray(moved), ctx, cu))[:n], np.asarray(out)[:n])
    if row_kernel and not (with_new_kv and uses_new_kv(t, s)):
        blocks = np.asarray(tables)[seqs, cols]
        kp_nan, vp_nan = (x.at[blocks].set(jnp.nan) for x in (kp, vp))
        np.testing.assert_array_equal(np.asarray(f(q, kp_nan, vp_nan, tables, ctx, cu))[:n], np.asarray(out)[:n])


def test_window_cases_cross_their_windows():
    """Every window case has tokens that see past both windows (else the window is not tested)."""
    for q_lens, prior, _, _ in WINDOW_CASES:
        assert max(p + q for p, q in zip(prior, q_lens)) > 200
