"""Paged attention kernel vs its jnp reference, in the Pallas interpreter on CPU.

Caches come from `random_paged_cache`: permuted block tables whose unused
slots point at blocks full of nan / 1e30, so reading anything outside a
sequence's context shows up as nan or a wrong value.
"""

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels import paged_attention, paged_attention_reference
from pallas_kernels.paged_attention import BlockSizes
from pallas_kernels.testing import (cu_from_lens, dense_attention_numpy, random_paged_cache,
                                    tolerance)

INTERPRET = True


def _batch(seed, context_lens, q_lens, *, num_kv_heads=2, group=3, head_dim=64,
           dtype=jnp.float32, block_size=16, pad_tokens=0, decode=False):
  rng = np.random.default_rng(seed)
  k_cache, v_cache, tables, ctx = random_paged_cache(
      rng, context_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
      dtype=dtype)
  cu = None if decode else jnp.asarray(cu_from_lens(q_lens))
  num_tokens = len(context_lens) if decode else int(sum(q_lens)) + pad_tokens
  q = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)), dtype)
  return q, k_cache, v_cache, tables, ctx, cu


def _check(out, args, num_valid, zero_rows=()):
  q = args[0]
  out = np.asarray(out.astype(jnp.float32))
  assert out.shape == q.shape
  assert not np.isnan(out).any()
  ref = np.asarray(paged_attention_reference(*args).astype(jnp.float32))
  np.testing.assert_allclose(out[:num_valid], ref[:num_valid], **tolerance(q.dtype))
  # Bucket padding past cu_q_lens[-1] and zero-context sequences give zeros.
  np.testing.assert_array_equal(out[num_valid:], 0.0)
  for row in zero_rows:
    np.testing.assert_array_equal(out[row], 0.0)


# Every interpreted case costs about a second of compile on CPU, so head_dim
# and dtype move together here; test_mixed_batch_with_padding_sequences runs
# (64, bf16) and test_auto_splits_long_context_few_sequences (128, f32).
@pytest.mark.parametrize("head_dim,dtype", [(64, jnp.float32), (128, jnp.bfloat16)],
                         ids=["64-f32", "128-bf16"])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_heads_and_dtypes(num_kv_heads, group, head_dim, dtype):
  # One decode sequence and one prefill chunk over a cached prefix.
  context_lens, q_lens = [21, 40], [1, 7]
  args = _batch(0, context_lens, q_lens, num_kv_heads=num_kv_heads, group=group,
                head_dim=head_dim, dtype=dtype, pad_tokens=2)
  out = paged_attention(*args, block_sizes=BlockSizes(block_q=4, pages_per_compute_block=2),
                        interpret=INTERPRET)
  _check(out, args, sum(q_lens))


RAGGED = [1, 3, 17, 64, 129]


@pytest.mark.parametrize("block_sizes,block_size", [
    (BlockSizes(), 16),
    (BlockSizes(block_q=1, pages_per_compute_block=1, num_splits=1), 16),
    (BlockSizes(block_q=16, pages_per_compute_block=4, num_splits=1), 16),
    (BlockSizes(block_q=8, pages_per_compute_block=2, num_splits=3), 32),
])
@pytest.mark.parametrize("mode", ["decode", "prefill", "chunked"])
def test_ragged_contexts(mode, block_sizes, block_size):
  if mode == "decode":
    q_lens = [1] * len(RAGGED)
  elif mode == "prefill":
    q_lens = RAGGED
  else:
    q_lens = [1, 2, 10, 33, 64]
  args = _batch(1, RAGGED, q_lens, block_size=block_size, decode=mode == "decode",
                pad_tokens=0 if mode == "decode" else 5)
  out = paged_attention(*args, block_sizes=block_sizes, interpret=INTERPRET)
  _check(out, args, sum(q_lens))


def test_mixed_batch_with_padding_sequences():
  # decode, empty slots, prefill chunks and a full prefill, then padding tokens.
  context_lens = [17, 0, 64, 5, 0, 33, 129, 1]
  q_lens = [1, 0, 16, 5, 0, 1, 40, 1]
  args = _batch(2, context_lens, q_lens, dtype=jnp.bfloat16, pad_tokens=9)
  out = paged_attention(*args, block_sizes=BlockSizes(block_q=8), interpret=INTERPRET)
  _check(out, args, sum(q_lens))


def test_decode_padding_sequences_give_zeros():
  context_lens = [33, 0, 7, 0]
  args = _batch(3, context_lens, None, decode=True, group=8, num_kv_heads=1)
  out = paged_attention(*args, interpret=INTERPRET)
  _check(out, args, len(context_lens), zero_rows=(1, 3))


@pytest.mark.parametrize("num_splits", [3])
def test_split_kv_matches_single_pass(num_splits):
  context_lens = [3, 129, 300]
  args = _batch(4, context_lens, [1, 1, 1], decode=True)
  whole = paged_attention(*args, block_sizes=BlockSizes(num_splits=1), interpret=INTERPRET)
  split = paged_attention(*args, block_sizes=BlockSizes(num_splits=num_splits),
                          interpret=INTERPRET)
  np.testing.assert_allclose(np.asarray(split), np.asarray(whole), **tolerance(jnp.float32))
  _check(split, args, len(context_lens))


def test_auto_splits_long_context_few_sequences():
  # One sequence, 2k context: the default BlockSizes picks flash decoding.
  context_lens = [2100]
  args = _batch(5, context_lens, [3], num_kv_heads=1, group=3, head_dim=128)
  out = paged_attention(*args, interpret=INTERPRET)
  _check(out, args, 3)


def test_reference_matches_contiguous_numpy():
  context_lens, q_lens = [9, 40, 17], [1, 40, 5]
  q, k_cache, v_cache, tables, ctx, cu = _batch(6, context_lens, q_lens)
  ref = np.asarray(paged_attention_reference(q, k_cache, v_cache, tables, ctx, cu))
  k_np, v_np, tables_np = (np.asarray(x) for x in (k_cache, v_cache, tables))
  cu_np = np.asarray(cu)
  for s, (c, n) in enumerate(zip(context_lens, q_lens)):
    blocks = tables_np[s, :-(-c // 16)]
    k = k_np[blocks].reshape(-1, *k_np.shape[2:])[:c]
    v = v_np[blocks].reshape(-1, *v_np.shape[2:])[:c]
    expected = dense_attention_numpy(q[cu_np[s]:cu_np[s + 1]], k, v,
                                     q_positions=np.arange(c - n, c))
    np.testing.assert_allclose(ref[cu_np[s]:cu_np[s + 1]], expected, **tolerance(jnp.float32))


@pytest.mark.parametrize("kwargs", [
    dict(block_q=3), dict(block_q=512), dict(pages_per_compute_block=0),
    dict(pages_per_compute_block=6), dict(num_splits=0), dict(num_splits=2.0),
    dict(num_warps=6),
])
def test_block_sizes_validation(kwargs):
  with pytest.raises(ValueError, match="BlockSizes"):
    BlockSizes(**kwargs)


def test_input_validation():
  q, k, v, tables, ctx, cu = _batch(7, [5, 9], [2, 3])
  cases = [
      ((q[0], k, v, tables, ctx, cu), "q must be"),
      ((q, k[0], v, tables, ctx, cu), "k_cache must be"),
      ((q, k, v[:, :8], tables, ctx, cu), "v_cache must have"),
      ((q[..., :32], k, v, tables, ctx, cu), "head_dim"),
      ((q[:, :5], k, v, tables, ctx, cu), "num_q_heads"),
      ((q, k[:, :12], v[:, :12], tables, ctx, cu), "block_size"),
      ((q, k.astype(jnp.bfloat16), v, tables, ctx, cu), "k_cache and v_cache"),
      ((q, k, v, tables[0], ctx, cu), "block_tables"),
      ((q, k, v, tables.astype(jnp.float32), ctx, cu), "block_tables"),
      ((q, k, v, tables, ctx[:1], cu), "context_lens"),
      ((q, k, v, tables, ctx, cu[:2]), "cu_q_lens"),
      ((q, k, v, tables, ctx, None), "without cu_q_lens"),
  ]
  for args, message in cases:
    with pytest.raises(ValueError, match=message):
      paged_attention(*args, interpret=INTERPRET)
  with pytest.raises(ValueError, match="block_sizes"):
    paged_attention(q, k, v, tables, ctx, cu, block_sizes=(4, 1, 1), interpret=INTERPRET)


def _poison_behind_windows(args, q_lens, window, num_poisoned):
  """The args with each sequence's table entries for pages wholly behind the window of its first
  new token pointed at poisoned blocks (nan K, 1e30 V): a window-aware cache may have given those
  blocks to another sequence, so the kernel must never follow them."""
  q, k, v, tables, ctx, cu = args
  tables = np.asarray(tables).copy()
  page = k.shape[1]
  spare = np.arange(k.shape[0] - num_poisoned, k.shape[0])  # random_paged_cache: unused, poisoned
  for s, (c, n) in enumerate(zip(np.asarray(ctx), q_lens)):
    first = max(int(c) - n + 1 - window, 0) // page
    tables[s, :first] = spare[0]
  return q, k, v, jnp.asarray(tables), ctx, cu


@pytest.mark.parametrize("window", [1, 13, 16, 40])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_sliding_window_skips_pages_behind_it(window, softcap):
  """Windows shorter than a page, off page boundaries, and over several compute blocks, on
  decode rows, chunked prefills over cached context and a fresh prompt that crosses its window,
  with bucket padding; pages behind every window point at poisoned blocks."""
  context_lens, q_lens = [70, 1, 45, 100, 33], [9, 1, 20, 1, 33]
  args = _batch(7, context_lens, q_lens, pad_tokens=3)
  tables = np.asarray(args[3])
  used = set(tables[s, j] for s, c in enumerate(context_lens) for j in range(-(-c // 16)))
  poisoned = [b for b in range(args[1].shape[0]) if b not in used]
  assert poisoned and max(poisoned) == args[1].shape[0] - 1
  clean_ref = paged_attention_reference(*args, window=window, softcap=softcap)
  args = _poison_behind_windows(args, q_lens, window, len(poisoned))
  out = paged_attention(*args, window=window, softcap=softcap, interpret=INTERPRET,
                        block_sizes=BlockSizes(block_q=4, pages_per_compute_block=2))
  out = np.asarray(out)
  n = sum(q_lens)
  assert not np.isnan(out).any()
  np.testing.assert_allclose(out[:n], np.asarray(clean_ref)[:n], **tolerance(jnp.float32))
  np.testing.assert_array_equal(out[n:], 0.0)


def test_sliding_window_with_split_kv_and_decode():
  """Flash decoding (num_splits > 1) splits only the steps inside each window."""
  context_lens = [3, 129, 300, 517]
  args = _batch(8, context_lens, None, decode=True)
  ref = paged_attention_reference(*args, window=100, softcap=5.0)
  for splits in (1, 3):
    out = paged_attention(*args, window=100, softcap=5.0, interpret=INTERPRET,
                          block_sizes=BlockSizes(num_splits=splits, pages_per_compute_block=1))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **tolerance(jnp.float32))


def test_window_reference_matches_numpy():
  """The reference's window: the query at p sees p - window < k <= p (numpy, one sequence)."""
  args = _batch(9, [50], [50])
  q, k, v, tables, ctx, cu = args
  kk = np.asarray(k)[np.asarray(tables)[0]].reshape(-1, *k.shape[2:])[:50]
  vv = np.asarray(v)[np.asarray(tables)[0]].reshape(-1, *v.shape[2:])[:50]
  ref = np.asarray(paged_attention_reference(*args, window=7))
  for t in (0, 6, 7, 30, 49):
    lo = max(t - 6, 0)
    want = dense_attention_numpy(q[t:t + 1], kk[lo:t + 1], vv[lo:t + 1], q_positions=[t - lo])
    np.testing.assert_allclose(ref[t], want[0], **tolerance(jnp.float32))
