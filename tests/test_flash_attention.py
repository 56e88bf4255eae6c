"""Varlen FlashAttention kernel vs its jnp reference, in the Pallas interpreter on CPU."""

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels import flash_attention, flash_attention_reference
from pallas_kernels.flash_attention import BlockSizes
from pallas_kernels.testing import cu_from_lens, dense_attention_numpy, tolerance

INTERPRET = True


def _inputs(seed, num_tokens, num_kv_heads, group, head_dim, dtype):
  rng = np.random.default_rng(seed)
  shape_q = (num_tokens, num_kv_heads * group, head_dim)
  shape_kv = (num_tokens, num_kv_heads, head_dim)
  return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in (shape_q, shape_kv, shape_kv))


def _check(out, q, k, v, cu, num_valid, *, causal=True, sm_scale=None):
  out = np.asarray(out.astype(jnp.float32))
  assert out.shape == q.shape
  assert not np.isnan(out).any()
  ref = np.asarray(flash_attention_reference(q, k, v, cu, causal=causal,
                                             sm_scale=sm_scale).astype(jnp.float32))
  np.testing.assert_allclose(out[:num_valid], ref[:num_valid], **tolerance(q.dtype))
  # Tokens in no sequence (bucket padding) come out as exact zeros.
  np.testing.assert_array_equal(out[num_valid:], 0.0)


# Every interpreted case costs about a second of compile on CPU, so head_dim
# and dtype move together here; test_other_dims_and_dtypes covers the other
# two pairings.
@pytest.mark.parametrize("head_dim,dtype", [(64, jnp.float32), (128, jnp.bfloat16)],
                         ids=["64-f32", "128-bf16"])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_heads_and_dtypes(num_kv_heads, group, head_dim, dtype):
  lens = [5, 19]
  q, k, v = _inputs(0, 27, num_kv_heads, group, head_dim, dtype)
  cu = jnp.asarray(cu_from_lens(lens))
  out = flash_attention(q, k, v, cu, block_sizes=BlockSizes(16, 16), interpret=INTERPRET)
  _check(out, q, k, v, cu, sum(lens))


@pytest.mark.parametrize("head_dim,dtype", [(128, jnp.float32), (64, jnp.bfloat16)],
                         ids=["128-f32", "64-bf16"])
def test_other_dims_and_dtypes(head_dim, dtype):
  lens = [7, 30]
  q, k, v = _inputs(6, 40, 2, 3, head_dim, dtype)
  cu = jnp.asarray(cu_from_lens(lens))
  out = flash_attention(q, k, v, cu, block_sizes=BlockSizes(16, 32), interpret=INTERPRET)
  _check(out, q, k, v, cu, sum(lens))


@pytest.mark.parametrize("block_q,block_kv,causal", [
    (16, 16, True), (32, 16, True), (16, 64, True), (64, 32, True),
    (16, 16, False), (64, 32, False),
])
def test_ragged_lengths_and_block_sizes(block_q, block_kv, causal):
  lens = [1, 3, 17, 64, 129]
  q, k, v = _inputs(1, sum(lens) + 6, 2, 2, 64, jnp.float32)
  cu = jnp.asarray(cu_from_lens(lens))
  out = flash_attention(q, k, v, cu, causal=causal, block_sizes=BlockSizes(block_q, block_kv),
                        interpret=INTERPRET)
  _check(out, q, k, v, cu, sum(lens), causal=causal)


def test_empty_sequences_odd_head_dim_and_scale():
  # Zero-length sequences between real ones; head_dim 48 takes the padded path.
  lens = [0, 7, 0, 0, 20, 0]
  q, k, v = _inputs(2, 32, 1, 3, 48, jnp.float32)
  cu = jnp.asarray(cu_from_lens(lens))
  out = flash_attention(q, k, v, cu, sm_scale=0.3, block_sizes=BlockSizes(16, 16),
                        interpret=INTERPRET)
  _check(out, q, k, v, cu, sum(lens), sm_scale=0.3)


def test_bf16_long_sequence_default_blocks():
  lens = [130, 70]
  q, k, v = _inputs(3, 200, 2, 3, 64, jnp.bfloat16)
  cu = jnp.asarray(cu_from_lens(lens))
  out = flash_attention(q, k, v, cu, interpret=INTERPRET)
  _check(out, q, k, v, cu, sum(lens))


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_per_sequence_numpy(causal):
  lens = [3, 17, 9]
  q, k, v = _inputs(4, sum(lens), 2, 3, 64, jnp.float32)
  cu = cu_from_lens(lens)
  ref = np.asarray(flash_attention_reference(q, k, v, jnp.asarray(cu), causal=causal))
  for s in range(len(lens)):
    a, b = cu[s], cu[s + 1]
    expected = dense_attention_numpy(q[a:b], k[a:b], v[a:b], q_positions=np.arange(b - a),
                                     causal=causal)
    np.testing.assert_allclose(ref[a:b], expected, **tolerance(jnp.float32))


@pytest.mark.parametrize("kwargs", [
    dict(block_q=8), dict(block_q=48), dict(block_kv=0), dict(block_kv=True),
    dict(block_q=16.0), dict(num_warps=3), dict(num_stages=0),
])
def test_block_sizes_validation(kwargs):
  with pytest.raises(ValueError, match="BlockSizes"):
    BlockSizes(**kwargs)


def test_block_sizes_is_hashable_and_frozen():
  assert hash(BlockSizes(32, 64)) == hash(BlockSizes(32, 64))
  with pytest.raises(Exception):
    BlockSizes().block_q = 32


def test_input_validation():
  q, k, v = _inputs(5, 8, 2, 2, 64, jnp.float32)
  cu = jnp.asarray([0, 8], jnp.int32)
  cases = [
      ((q[0], k, v, cu), "q must be"),
      ((q, k[0], v, cu), "k must be"),
      ((q, k, v[:, :1], cu), "v must have"),
      ((q, k[:4], v[:4], cu), "k has 4 tokens"),
      ((q, k[..., :32], v[..., :32], cu), "head_dim"),
      ((q[:, :3], k, v, cu), "num_q_heads"),
      ((q, k.astype(jnp.bfloat16), v, cu), "k and v must have"),
      ((q.astype(jnp.int32), k, v, cu), "q must be floating"),
      ((q, k, v, jnp.asarray([8], jnp.int32)), "cu_seqlens"),
      ((q, k, v, jnp.asarray([0.0, 8.0])), "cu_seqlens"),
  ]
  for args, message in cases:
    with pytest.raises(ValueError, match=message):
      flash_attention(*args, interpret=INTERPRET)
  with pytest.raises(ValueError, match="block_sizes"):
    flash_attention(q, k, v, cu, block_sizes=(16, 16), interpret=INTERPRET)


@pytest.mark.parametrize("window,softcap,block_q,block_kv", [
    (1, None, 16, 16), (13, 2.0, 16, 16), (16, None, 32, 16), (40, 3.0, 16, 64), (100, None, 64, 32),
])
def test_sliding_window(window, softcap, block_q, block_kv):
  """Ragged sequences that cross their windows match the reference; and the key tiles behind
  every window of a query tile are never loaded: with the last sequence's first 32 keys NaN, the
  query tiles whose windows all start past those keys' tile come out the same."""
  lens = [1, 3, 17, 64, 129]
  n = sum(lens)
  q, k, v = _inputs(2, n + 6, 2, 2, 64, jnp.float32)
  cu = jnp.asarray(cu_from_lens(lens))
  ref = np.asarray(flash_attention_reference(q, k, v, cu, window=window, softcap=softcap))
  run = lambda k, v: np.asarray(flash_attention(q, k, v, cu, window=window, softcap=softcap,  # noqa: E731
                                                block_sizes=BlockSizes(block_q, block_kv), interpret=INTERPRET))
  out = run(k, v)
  np.testing.assert_allclose(out[:n], ref[:n], **tolerance(jnp.float32))
  last = int(cu[-2])
  poisoned_end = last + 32
  seq_start = np.repeat(np.asarray(cu)[:-1], lens)
  first_key = np.concatenate([np.maximum(seq_start, np.arange(n) + 1 - window), np.full(6, n)])
  padded = -(-(n + 6) // max(block_q, block_kv)) * max(block_q, block_kv)
  first_key = np.concatenate([first_key, np.full(padded - n - 6, n)])
  tile_lo = first_key.reshape(-1, block_q).min(axis=1) // block_kv * block_kv  # first key each tile loads
  clean_rows = np.repeat(tile_lo >= poisoned_end, block_q)[:n]
  if clean_rows.any():
    again = run(k.at[last:poisoned_end].set(jnp.nan), v.at[last:poisoned_end].set(jnp.nan))
    np.testing.assert_array_equal(again[:n][clean_rows], out[:n][clean_rows])
    assert window > 64 or clean_rows.sum() >= 32  # the check covered a good part of the sequence


def test_window_reference_matches_numpy():
  lens = [40]
  q, k, v = _inputs(3, 40, 1, 2, 32, jnp.float32)
  cu = jnp.asarray(cu_from_lens(lens))
  ref = np.asarray(flash_attention_reference(q, k, v, cu, window=5))
  for t in (0, 4, 5, 39):
    lo = max(t - 4, 0)
    want = dense_attention_numpy(q[t:t + 1], k[lo:t + 1], v[lo:t + 1], q_positions=[t - lo])
    np.testing.assert_allclose(ref[t], want[0], **tolerance(jnp.float32))
