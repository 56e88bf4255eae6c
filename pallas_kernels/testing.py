"""Helpers shared by the kernel tests and the benchmark: tolerances and paged inputs."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

# The one tolerance table for kernel-vs-reference comparisons, by dtype.
# bf16: p is rounded to bf16 before the p @ v matmul (as every FlashAttention
# does), and the output itself is rounded to bf16, ~3 significant digits.
TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5),
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
}


def tolerance(dtype) -> dict:
  return TOLERANCES[jnp.dtype(dtype)]


def cu_from_lens(lens) -> np.ndarray:
  return np.concatenate([[0], np.cumsum(np.asarray(lens, np.int64))]).astype(np.int32)


def random_paged_cache(rng: np.random.Generator, context_lens, *, block_size: int,
                       num_kv_heads: int, head_dim: int, dtype, num_blocks: int | None = None,
                       max_blocks_per_seq: int | None = None, poison: bool = True):
  """Random k/v caches and a permuted block table for the given context lengths.

  With poison=True every block no sequence uses is filled with nan (k) and
  1e30 (v), the slots past each context in its last block likewise, and table
  slots past a sequence's last block point at those poisoned blocks, so a
  kernel that reads anything it should not produces nan or garbage.
  """
  context_lens = np.asarray(context_lens, np.int32)
  pages = [-(-int(c) // block_size) for c in context_lens]
  needed = sum(pages)
  if max_blocks_per_seq is None:
    max_blocks_per_seq = max(1, max(pages, default=1) + 1)
  if num_blocks is None:
    num_blocks = needed + 3
  if num_blocks < needed:
    raise ValueError(f"num_blocks={num_blocks} < {needed} blocks the contexts need")
  shape = (num_blocks, block_size, num_kv_heads, head_dim)
  k = rng.standard_normal(shape).astype(np.float32)
  v = rng.standard_normal(shape).astype(np.float32)
  perm = rng.permutation(num_blocks)
  used, spare = perm[:needed], perm[needed:]
  tables = np.empty((len(context_lens), max_blocks_per_seq), np.int32)
  offset = 0
  for s, n in enumerate(pages):
    tables[s, :n] = used[offset:offset + n]
    offset += n
    # Garbage past the last block: spare (poisoned) blocks or the highest index.
    filler = spare if len(spare) else np.array([num_blocks - 1])
    tables[s, n:] = rng.choice(filler, max_blocks_per_seq - n)
  if poison:
    k[spare], v[spare] = np.nan, 1e30
    for s, n in enumerate(pages):
      tail = int(context_lens[s]) - (n - 1) * block_size
      if n and tail < block_size:
        k[tables[s, n - 1], tail:] = np.nan
        v[tables[s, n - 1], tail:] = 1e30
  return (jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables),
          jnp.asarray(context_lens))


def dense_attention_numpy(q, k, v, *, q_positions, causal=True, sm_scale=None):
  """Plain float64 attention of q [n, Hq, D] over k, v [m, Hkv, D] (one sequence)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  group = q.shape[1] // k.shape[1]
  k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
  scale = sm_scale if sm_scale is not None else 1.0 / np.sqrt(q.shape[-1])
  s = np.einsum("qhd,khd->hqk", q, k) * scale
  if causal:
    s = np.where(np.arange(k.shape[0])[None, None, :] <= np.asarray(q_positions)[None, :, None],
                 s, -np.inf)
  s = s - s.max(-1, keepdims=True)
  p = np.exp(s)
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hqk,khd->qhd", p, v)
