"""Varlen FlashAttention (prefill, causal or not) as a Pallas kernel, with a jnp reference.

Sequences are packed back to back along the token axis and delimited by
``cu_seqlens`` (the FlashAttention-2 "varlen" layout). A sliding ``window`` (causal
only) lets each query see its last ``window`` keys: key tiles wholly behind every
row's window are never loaded, and partial ones are masked. ``softcap`` caps the
scores (Gemma 2). Grouped-query attention
is handled by indexing the kv head as ``q_head // group``; repeated k/v are never
materialized.

Layout of the three parts, as in JAX's own Pallas ops: the kernel body, the
public jitted wrapper with keyword-only tuning knobs, and a jnp reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._util import (LOG2_E, MASK_VALUE, cdiv, is_power_of_two, multiple_of,
                                  next_power_of_two, online_softmax_step, triton_compiler_params)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes for `flash_attention`.

  block_q / block_kv are the rows of the query / key tiles that feed the two
  matmuls. The Triton lowering needs power-of-two tensor sizes and tl.dot needs
  every dimension >= 16. num_warps / num_stages are passed to Triton on GPU
  (None keeps Pallas' defaults) and ignored in interpret mode.
  """

  block_q: int = 64
  block_kv: int = 64
  num_warps: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    for name in ("block_q", "block_kv"):
      value = getattr(self, name)
      if not is_power_of_two(value) or value < 16:
        raise ValueError(
            f"BlockSizes.{name} must be a power of two >= 16 (Triton needs "
            f"power-of-two tiles and dot operands of at least 16), got {value!r}")
    for name in ("num_warps", "num_stages"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                or value < 1):
        raise ValueError(f"BlockSizes.{name} must be None or a positive int, got {value!r}")
    if self.num_warps is not None and not is_power_of_two(self.num_warps):
      raise ValueError(f"BlockSizes.num_warps must be a power of two, got {self.num_warps!r}")


# ---------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------


def _flash_kernel(row_start_ref, row_end_ref, q_ref, k_ref, v_ref, o_ref, *,
                  scale_log2: float, causal: bool, block_q: int, block_kv: int,
                  window: int | None, softcap: float | None):
  # row_start_ref: [block_q] int32  first key (token index) each query row may see
  # row_end_ref:   [block_q] int32  one past the last key of the row's sequence
  # q_ref:         [block_q, head_dim]
  # k_ref, v_ref:  [padded_tokens, head_dim]  (this program's kv head)
  # o_ref:         [block_q, head_dim]
  head_dim = q_ref.shape[-1]
  q_block_id = pl.program_id(0)
  row_ids = q_block_id * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
  row_start = row_start_ref[...]
  row_end = row_end_ref[...]
  if causal:
    row_end = jnp.minimum(row_end, row_ids + 1)
  if window is not None:
    row_start = jnp.maximum(row_start, row_ids + 1 - window)
  # Rows outside every sequence carry start = padded_tokens, end = 0, so they
  # drop out of both reductions; a block of only such rows runs zero steps.
  # With a window, the loop starts at the tile of the earliest window's start.
  kv_block_lo = lax.div(jnp.min(row_start), block_kv)
  kv_block_hi = cdiv(jnp.max(row_end), block_kv)

  q = q_ref[...]

  def body(kv_block, carry):
    kv_start = multiple_of(kv_block * block_kv, block_kv)
    k = k_ref[pl.ds(kv_start, block_kv), :]  # [block_kv, head_dim]
    v = v_ref[pl.ds(kv_start, block_kv), :]  # [block_kv, head_dim]
    key_ids = kv_start + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
    mask = ((key_ids[None, :] >= row_start[:, None])
            & (key_ids[None, :] < row_end[:, None]))  # [block_q, block_kv]
    return online_softmax_step(carry, q, k, v, mask, scale_log2, softcap)

  carry = (jnp.full((block_q,), MASK_VALUE, jnp.float32),
           jnp.zeros((block_q,), jnp.float32),
           jnp.zeros((block_q, head_dim), jnp.float32))
  _, l, acc = lax.fori_loop(kv_block_lo, kv_block_hi, body, carry)
  # Rows that saw no key (padding) have l == 0; they get 0 instead of nan.
  l = jnp.where(l == 0.0, 1.0, l)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


# ---------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------


def _check_inputs(q, k, v, cu_seqlens):
  if q.ndim != 3:
    raise ValueError(f"q must be [tokens, num_q_heads, head_dim], got shape {q.shape}")
  if k.ndim != 3:
    raise ValueError(f"k must be [tokens, num_kv_heads, head_dim], got shape {k.shape}")
  if v.shape != k.shape:
    raise ValueError(f"v must have the shape of k {k.shape}, got {v.shape}")
  if k.shape[0] != q.shape[0]:
    raise ValueError(f"k has {k.shape[0]} tokens but q has {q.shape[0]}")
  if k.shape[2] != q.shape[2]:
    raise ValueError(f"k head_dim {k.shape[2]} differs from q head_dim {q.shape[2]}")
  if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
    raise ValueError(
        f"q's num_q_heads ({q.shape[1]}) must be a multiple of k's num_kv_heads ({k.shape[1]})")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q must be floating point, got {q.dtype}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"k and v must have q's dtype {q.dtype}, got k {k.dtype}, v {v.dtype}")
  if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
    raise ValueError(f"cu_seqlens must be 1-D of length num_seqs + 1 >= 2, got shape "
                     f"{cu_seqlens.shape}")
  if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
    raise ValueError(f"cu_seqlens must be an integer array, got {cu_seqlens.dtype}")


def _row_bounds(cu_seqlens, num_tokens: int, padded_tokens: int):
  """Per query row: [start, end) of its sequence; empty for rows in no sequence."""
  cu = cu_seqlens.astype(jnp.int32)
  num_seqs = cu.shape[0] - 1
  rows = jnp.arange(padded_tokens, dtype=jnp.int32)
  seq_ids = jnp.searchsorted(cu, rows, side="right").astype(jnp.int32) - 1
  in_seq = (seq_ids >= 0) & (seq_ids < num_seqs) & (rows < num_tokens)
  seq_ids = jnp.clip(seq_ids, 0, num_seqs - 1)
  start = jnp.where(in_seq, cu[seq_ids], padded_tokens)
  end = jnp.where(in_seq, jnp.minimum(cu[seq_ids + 1], num_tokens), 0)
  return start, end


def _check_window_softcap(causal, window, softcap):
  if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
    raise ValueError(f"window must be None or a positive int, got {window!r}")
  if window is not None and not causal:
    raise ValueError("a sliding window needs causal attention")
  if softcap is not None and not softcap > 0:
    raise ValueError(f"softcap must be None or > 0, got {softcap!r}")


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_sizes", "interpret", "window",
                                             "softcap"))
def flash_attention(q, k, v, cu_seqlens, *, causal: bool = True, sm_scale: float | None = None,
                    block_sizes: BlockSizes | None = None, interpret: bool = False,
                    window: int | None = None, softcap: float | None = None):
  """Varlen (packed) multi-head attention with GQA.

  Args:
    q: [tokens, num_q_heads, head_dim].
    k, v: [tokens, num_kv_heads, head_dim]; num_q_heads % num_kv_heads == 0.
    cu_seqlens: int [num_seqs + 1], non-decreasing token offsets of the packed
      sequences. Tokens outside [cu_seqlens[0], cu_seqlens[-1]) belong to no
      sequence and come out as zeros.
    causal: a token attends only to earlier tokens of its own sequence.
    sm_scale: softmax scale, default 1/sqrt(head_dim).
    block_sizes: `BlockSizes` tiling.
    interpret: run the Pallas interpreter (CPU tests).
    window: causal sliding window; a token sees itself and the window - 1 before it.
    softcap: scores s (after the scale) become softcap * tanh(s / softcap).

  Returns:
    [tokens, num_q_heads, head_dim] in q's dtype.
  """
  _check_inputs(q, k, v, cu_seqlens)
  _check_window_softcap(causal, window, softcap)
  if block_sizes is None:
    block_sizes = BlockSizes()
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a flash_attention.BlockSizes, got {block_sizes!r}")
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads = k.shape[1]
  group = num_q_heads // num_kv_heads
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  if num_tokens == 0:
    return jnp.zeros_like(q)
  block_q, block_kv = block_sizes.block_q, block_sizes.block_kv

  # Padding keeps every pl.ds load in bounds (Triton does no bounds checks) and
  # the head dim a power of two (Triton tensor sizes). Zero head-dim columns do
  # not change q.k and give zero output columns, sliced off below.
  tile = max(block_q, block_kv)
  padded_tokens = -(-num_tokens // tile) * tile
  padded_dim = max(16, next_power_of_two(head_dim))
  pad = ((0, padded_tokens - num_tokens), (0, 0), (0, padded_dim - head_dim))
  if any(p != (0, 0) for p in pad):
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
  row_start, row_end = _row_bounds(cu_seqlens, num_tokens, padded_tokens)

  kernel = functools.partial(_flash_kernel, scale_log2=float(sm_scale) * LOG2_E,
                             causal=causal, block_q=block_q, block_kv=block_kv, window=window,
                             softcap=softcap)
  grid = (padded_tokens // block_q, num_q_heads)
  out = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[
          pl.BlockSpec((block_q,), lambda i, h: (i,)),
          pl.BlockSpec((block_q,), lambda i, h: (i,)),
          pl.BlockSpec((block_q, None, padded_dim), lambda i, h: (i, h, 0)),
          pl.BlockSpec((padded_tokens, None, padded_dim), lambda i, h: (0, h // group, 0)),
          pl.BlockSpec((padded_tokens, None, padded_dim), lambda i, h: (0, h // group, 0)),
      ],
      out_specs=pl.BlockSpec((block_q, None, padded_dim), lambda i, h: (i, h, 0)),
      out_shape=jax.ShapeDtypeStruct((padded_tokens, num_q_heads, padded_dim), q.dtype),
      compiler_params=None if interpret else triton_compiler_params(block_sizes.num_warps,
                                                            block_sizes.num_stages),
      interpret=interpret,
      name="flash_attention_varlen",
  )(row_start, row_end, q, k, v)
  return out[:num_tokens, :, :head_dim]


# ---------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "window", "softcap"))
def flash_attention_reference(q, k, v, cu_seqlens, *, causal: bool = True,
                              sm_scale: float | None = None, window: int | None = None,
                              softcap: float | None = None):
  """Dense masked attention in f32 with the semantics of `flash_attention`."""
  _check_inputs(q, k, v, cu_seqlens)
  _check_window_softcap(causal, window, softcap)
  num_tokens, num_q_heads, head_dim = q.shape
  group = num_q_heads // k.shape[1]
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  start, end = _row_bounds(cu_seqlens, num_tokens, num_tokens)
  keys = jnp.arange(num_tokens)
  mask = (keys[None, :] >= start[:, None]) & (keys[None, :] < end[:, None])
  if causal:
    mask &= keys[None, :] <= keys[:, None]
  if window is not None:
    mask &= keys[None, :] > keys[:, None] - window
  hi = lax.Precision.HIGHEST
  k32 = jnp.repeat(k.astype(jnp.float32), group, axis=1)
  v32 = jnp.repeat(v.astype(jnp.float32), group, axis=1)
  s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k32, precision=hi) * sm_scale
  if softcap is not None:
    s = jnp.tanh(s / softcap) * softcap
  s = jnp.where(mask[None], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(mask[None], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0.0, 1.0, denom)
  return jnp.einsum("hqk,khd->qhd", p, v32, precision=hi).astype(q.dtype)
