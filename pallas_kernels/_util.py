"""Small helpers shared by the kernel files (jax only)."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Finite stand-in for -inf: exp2(MASK_VALUE - m) underflows to 0 without the
# inf - inf = nan that a true -inf produces when a whole row is masked.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2_E = math.log2(math.e)

# An alignment hint for Triton; identity if this jax lacks it.
multiple_of = getattr(pl, "multiple_of", lambda x, _: x)


def is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def is_power_of_two(x) -> bool:
  return is_int(x) and x > 0 and (x & (x - 1)) == 0


def next_power_of_two(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def cdiv(a, b):
  """Ceil division of non-negative traced ints; lax.div is one divide on Triton."""
  return lax.div(a + (b - 1), b)


def full_spec(shape):
  """BlockSpec covering a whole (small index) array, read by scalar indexing."""
  return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def triton_compiler_params(num_warps, num_stages):
  """Triton launch settings, always explicit on GPU.

  Passing Triton's CompilerParams (even empty) picks the Triton lowering: with None, some jax
  versions default to Mosaic GPU, which these kernels are not written for. None only when this
  jax has no Triton backend.
  """
  try:
    from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415 (GPU-only extra)
  except ImportError:
    return None
  kwargs = {}
  if num_warps is not None:
    kwargs["num_warps"] = num_warps
  if num_stages is not None:
    kwargs["num_stages"] = num_stages
  try:
    return pltriton.CompilerParams(**kwargs)
  except (AttributeError, TypeError):
    return None


def online_softmax_step(carry, q, k, v, mask, scale_log2, softcap=None):
  """One key tile of FlashAttention's online softmax, in the log2 domain, accumulating in f32.

  carry: (running max [rows], running sum [rows], accumulator [rows, head_dim]);
  q [rows, d], k and v [keys, d], mask [rows, keys] (True = attend). `softcap` (Gemma 2) caps the
  scaled scores s to softcap * tanh(s / softcap); in the log2 domain that is the same cap times
  log2(e).
  """
  m_prev, l_prev, acc_prev = carry
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                      preferred_element_type=jnp.float32) * scale_log2
  if softcap is not None:
    cap = softcap * LOG2_E
    s = jnp.tanh(s / cap) * cap
  s = jnp.where(mask, s, MASK_VALUE)
  m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
  alpha = jnp.exp2(m_prev - m_new)
  p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
  l_new = alpha * l_prev + jnp.sum(p, axis=1)
  pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                       preferred_element_type=jnp.float32)
  return m_new, l_new, acc_prev * alpha[:, None] + pv
