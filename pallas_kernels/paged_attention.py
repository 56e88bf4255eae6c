"""Paged attention over a block-table KV cache as a Pallas kernel, with a jnp reference.

One kernel serves decode (one new token per sequence), prefill over a cached
prefix and chunked prefill, mixed in one batch. The new tokens' k/v are already
in the cache; query token i of sequence s sits at position
``context_lens[s] - q_len[s] + i`` and attends causally up to that position.

Work decomposition (all index math happens in jnp before the kernel, so the
kernel needs no scalar prefetch):

* The queries of each sequence are cut into tiles of ``block_q`` tokens. A tile
  is one *work item*. The number of work items is bounded statically by
  ``min(S, T) + (T - min(S, T)) // block_q``, so the grid is static.
* For a work item and a kv head, the tile's tokens times the q heads of that kv
  head (padded to a power of two) form the rows of one query matrix, so each
  KV page is read once per kv head, not once per q head.
* Optionally the kv length is split into ``num_splits`` parts (flash decoding);
  the partial (out, max, sum) triples are merged by a small jnp reduction.
* With a sliding ``window``, a query at position p sees keys p - window < k <= p.
  A work item's loop starts at the compute block holding its first query's
  first visible key: pages wholly behind every window of the tile are never
  read, and their table entries are never followed (a window-aware cache may
  have given those blocks to another sequence). ``softcap`` caps the scores.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._util import (LOG2_E, MASK_VALUE, cdiv, full_spec, is_int, is_power_of_two,
                                  next_power_of_two, online_softmax_step, triton_compiler_params)

# Programs that roughly fill a large GPU; below this, flash decoding splits kv.
_TARGET_PROGRAMS = 128
_MAX_AUTO_SPLITS = 16
_AUTO_ROWS = 64


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling for `paged_attention`. None picks a value from the static shapes.

  block_q: query tokens of one sequence per work item (power of two). The
    kernel's query matrix has max(16, block_q * pow2(q_heads_per_kv_head))
    rows. None: 1 for pure decode (cu_q_lens is None), else enough tokens for
    64 rows.
  pages_per_compute_block: KV pages gathered into one key tile (power of two).
    None: enough pages for 64 keys.
  num_splits: parts the kv length of every work item is split into (flash
    decoding). None: split only when there are few programs and long contexts.
  num_warps / num_stages: Triton settings on GPU, ignored in interpret mode.
  """

  block_q: int | None = None
  pages_per_compute_block: int | None = None
  num_splits: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    for name in ("block_q", "pages_per_compute_block"):
      value = getattr(self, name)
      if value is not None and not is_power_of_two(value):
        raise ValueError(
            f"BlockSizes.{name} must be None or a power of two (Triton needs "
            f"power-of-two tiles), got {value!r}")
    if self.block_q is not None and self.block_q > 256:
      raise ValueError(f"BlockSizes.block_q must be <= 256, got {self.block_q}")
    for name in ("num_splits", "num_warps", "num_stages"):
      value = getattr(self, name)
      if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"BlockSizes.{name} must be None or a positive int, got {value!r}")
    if self.num_warps is not None and not is_power_of_two(self.num_warps):
      raise ValueError(f"BlockSizes.num_warps must be a power of two, got {self.num_warps!r}")


# ---------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------


def _paged_kernel(work_seq_ref, work_pos_ref, work_kv_len_ref, block_tables_ref,
                  q_ref, k_ref, v_ref, *out_refs, scale_log2: float, heads_pad: int,
                  page_size: int, pages_per_compute_block: int, num_splits: int,
                  window: int | None, softcap: float | None):
  # work_seq_ref:     [num_work] int32  sequence of each work item
  # work_pos_ref:     [num_work] int32  position of the tile's first query token
  # work_kv_len_ref:  [num_work] int32  keys the tile needs (last position + 1)
  # block_tables_ref: [num_seqs, padded_blocks_per_seq] int32
  # q_ref:            [rows, head_dim]  row = token_in_tile * heads_pad + head_in_group
  # k_ref, v_ref:     [num_blocks, page_size, num_kv_heads, head_dim]  the whole pool, unblocked:
  #                   the program reads only its kv head's pages, so no block of the pool is
  #                   ever staged or copied (the pools are donated and updated in place)
  # out_refs: o_ref [rows, head_dim], and with num_splits > 1 also
  #           m_ref [rows] (running max, log2 domain), l_ref [rows] (running sum);
  #           with splits o_ref holds the unnormalized accumulator in f32.
  work = pl.program_id(0)
  kv_head = pl.program_id(1)
  split = pl.program_id(2)
  rows, head_dim = q_ref.shape
  num_blocks = k_ref.shape[0]
  keys_per_step = pages_per_compute_block * page_size

  seq = work_seq_ref[work]
  first_pos = work_pos_ref[work]
  kv_len = work_kv_len_ref[work]
  token_in_tile = lax.div(lax.broadcasted_iota(jnp.int32, (rows,), 0), heads_pad)
  # Causal limit of every row. Rows past the tile's last token (and padded
  # heads) are clamped to kv_len: finite garbage, never read back.
  row_limit = jnp.minimum(first_pos + token_in_tile + 1, kv_len)  # [rows]
  # First key each row sees (its window's start), and the tile's earliest one.
  if window is None:
    row_first = jnp.zeros_like(row_limit)
    tile_first = jnp.int32(0)
  else:
    row_first = jnp.maximum(first_pos + token_in_tile + 1 - window, 0)
    tile_first = jnp.maximum(first_pos + 1 - window, 0)
  first_page = lax.div(tile_first, page_size)

  num_pages = cdiv(kv_len, page_size)
  num_steps = cdiv(num_pages, pages_per_compute_block)
  first_step = jnp.minimum(lax.div(first_page, pages_per_compute_block), num_steps)
  steps_per_split = cdiv(num_steps - first_step, num_splits)
  step_lo = jnp.minimum(first_step + split * steps_per_split, num_steps)
  step_hi = jnp.minimum(step_lo + steps_per_split, num_steps)

  q = q_ref[...]

  def body(step, carry):
    page_lo = step * pages_per_compute_block
    page_ids = page_lo + lax.broadcasted_iota(jnp.int32, (pages_per_compute_block,), 0)
    block_ids = block_tables_ref[seq, pl.ds(page_lo, pages_per_compute_block)]
    # Table slots past the sequence's last page hold garbage, and so may those of pages
    # behind the tile's windows; never follow them.
    block_ids = jnp.where((page_ids < num_pages) & (page_ids >= first_page), block_ids, 0)
    block_ids = jnp.clip(block_ids, 0, num_blocks - 1)
    k = k_ref[block_ids, :, kv_head, :].reshape(keys_per_step, head_dim)  # [keys_per_step, head_dim]
    v = v_ref[block_ids, :, kv_head, :].reshape(keys_per_step, head_dim)  # [keys_per_step, head_dim]
    key_pos = page_lo * page_size + lax.broadcasted_iota(jnp.int32, (keys_per_step,), 0)
    # Slots past kv_len in the last page may hold nan; 0 * nan would leak into
    # the p @ v product, so v is zeroed there, not only p.
    v = jnp.where(((key_pos < kv_len) & (key_pos >= first_page * page_size))[:, None], v,
                  jnp.zeros_like(v))
    mask = (key_pos[None, :] < row_limit[:, None]) & (key_pos[None, :] >= row_first[:, None])
    return online_softmax_step(carry, q, k, v, mask, scale_log2, softcap)

  carry = (jnp.full((rows,), MASK_VALUE, jnp.float32),
           jnp.zeros((rows,), jnp.float32),
           jnp.zeros((rows, head_dim), jnp.float32))
  m, l, acc = lax.fori_loop(step_lo, step_hi, body, carry)
  if num_splits == 1:
    (o_ref,) = out_refs
    l = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  else:
    o_ref, m_ref, l_ref = out_refs
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


# ---------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens, cu_q_lens):
  if q.ndim != 3:
    raise ValueError(f"q must be [tokens, num_q_heads, head_dim], got shape {q.shape}")
  if k_cache.ndim != 4:
    raise ValueError("k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                     f"got shape {k_cache.shape}")
  if v_cache.shape != k_cache.shape:
    raise ValueError(f"v_cache must have k_cache's shape {k_cache.shape}, got {v_cache.shape}")
  num_tokens, num_q_heads, head_dim = q.shape
  _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
  if cache_head_dim != head_dim:
    raise ValueError(f"k_cache head_dim {cache_head_dim} differs from q head_dim {head_dim}")
  if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
    raise ValueError(f"q's num_q_heads ({num_q_heads}) must be a multiple of k_cache's "
                     f"num_kv_heads ({num_kv_heads})")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q must be floating point, got {q.dtype}")
  if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
    raise ValueError(f"k_cache and v_cache must have q's dtype {q.dtype}, got "
                     f"{k_cache.dtype} and {v_cache.dtype}")
  if block_tables.ndim != 2 or block_tables.shape[1] == 0:
    raise ValueError("block_tables must be [num_seqs, max_blocks_per_seq], got shape "
                     f"{block_tables.shape}")
  if not jnp.issubdtype(block_tables.dtype, jnp.integer):
    raise ValueError(f"block_tables must be an integer array, got {block_tables.dtype}")
  num_seqs = block_tables.shape[0]
  if context_lens.shape != (num_seqs,):
    raise ValueError(f"context_lens must have shape ({num_seqs},) to match block_tables, "
                     f"got {context_lens.shape}")
  if not jnp.issubdtype(context_lens.dtype, jnp.integer):
    raise ValueError(f"context_lens must be an integer array, got {context_lens.dtype}")
  if cu_q_lens is None:
    if num_tokens != num_seqs:
      raise ValueError(f"without cu_q_lens every sequence has one query, so q needs "
                       f"{num_seqs} tokens (block_tables rows), got {num_tokens}")
  else:
    if cu_q_lens.shape != (num_seqs + 1,):
      raise ValueError(f"cu_q_lens must have shape ({num_seqs + 1},), got {cu_q_lens.shape}")
    if not jnp.issubdtype(cu_q_lens.dtype, jnp.integer):
      raise ValueError(f"cu_q_lens must be an integer array, got {cu_q_lens.dtype}")


def _resolve_block_sizes(block_sizes, *, decode_only, heads_pad, page_size, num_tokens,
                         num_seqs, num_kv_heads, max_blocks_per_seq):
  if block_sizes is None:
    block_sizes = BlockSizes()
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a paged_attention.BlockSizes, got {block_sizes!r}")
  block_q = block_sizes.block_q
  if block_q is None:
    block_q = 1 if decode_only else max(1, _AUTO_ROWS // heads_pad)
  pages = block_sizes.pages_per_compute_block
  if pages is None:
    pages = max(1, 64 // page_size)
  if pages * page_size < 16:
    raise ValueError(f"BlockSizes.pages_per_compute_block * block_size must be >= 16 (Triton "
                     f"dot operands), got {pages} * {page_size}")
  active_seqs = min(num_seqs, num_tokens)
  num_work = max(1, active_seqs + (num_tokens - active_seqs) // block_q)
  num_splits = block_sizes.num_splits
  if num_splits is None:
    programs = num_work * num_kv_heads
    max_steps = -(-max_blocks_per_seq // pages)
    if programs >= _TARGET_PROGRAMS or max_blocks_per_seq * page_size < 2048:
      num_splits = 1
    else:
      # Keep at least ~4 compute steps per split so the merge stays cheap.
      num_splits = min(_MAX_AUTO_SPLITS, -(-_TARGET_PROGRAMS // programs),
                       max(1, max_steps // 4))
  return block_q, pages, num_splits, num_work


def _work_items(cu_q, context_lens, num_work: int, block_q: int):
  """Static-size list of (sequence, query-tile) work items, plus per-token lookup."""
  num_seqs = context_lens.shape[0]
  q_lens = jnp.maximum(cu_q[1:] - cu_q[:-1], 0)
  tiles = lax.div(q_lens + (block_q - 1), block_q)
  tile_end = jnp.cumsum(tiles)
  tile_start = tile_end - tiles
  work = jnp.arange(num_work, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(tile_end, work, side="right"), 0, num_seqs - 1)
  seq = seq.astype(jnp.int32)
  real = work < tile_end[-1]
  q_offset = (work - tile_start[seq]) * block_q  # within the sequence's new tokens
  q_count = jnp.where(real, jnp.clip(q_lens[seq] - q_offset, 0, block_q), 0)
  ctx = context_lens[seq]
  first_pos = ctx - q_lens[seq] + q_offset
  kv_len = jnp.where(q_count > 0, jnp.clip(first_pos + q_count, 0, ctx), 0)
  first_token = cu_q[seq] + q_offset
  return dict(seq=seq, first_pos=first_pos, kv_len=kv_len, first_token=first_token,
              tile_start=tile_start)


def _check_window_softcap(window, softcap):
  if window is not None and (not is_int(window) or window < 1):
    raise ValueError(f"window must be None or a positive int, got {window!r}")
  if softcap is not None and not softcap > 0:
    raise ValueError(f"softcap must be None or > 0, got {softcap!r}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret", "window", "softcap"))
def paged_attention(q, k_cache, v_cache, block_tables, context_lens, cu_q_lens=None, *,
                    sm_scale: float | None = None, block_sizes: BlockSizes | None = None,
                    interpret: bool = False, window: int | None = None, softcap: float | None = None):
  """Causal attention of new query tokens over a paged KV cache.

  Args:
    q: [tokens, num_q_heads, head_dim], the new tokens of all sequences packed.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; the new
      tokens' k/v are already written.
    block_tables: int [num_seqs, max_blocks_per_seq]; slots past a sequence's
      last used block are never read, whatever they hold.
    context_lens: int [num_seqs], tokens in each sequence including the new ones.
    cu_q_lens: int [num_seqs + 1] offsets of each sequence's new tokens in q;
      None means one new token per sequence (decode, tokens == num_seqs).
      Requires q_len[s] <= context_lens[s] and cu_q_lens[-1] <= tokens.
    sm_scale: softmax scale, default 1/sqrt(head_dim).
    block_sizes: `BlockSizes` tiling.
    interpret: run the Pallas interpreter (CPU tests).
    window: a sliding window: each query sees itself and the window - 1 keys before it;
      table entries of blocks behind every window of a work item are never followed.
    softcap: scores s (after the scale) become softcap * tanh(s / softcap).

  Returns:
    [tokens, num_q_heads, head_dim] in q's dtype. Sequences with
    context_len 0 or q_len 0 are fine. Rows of q past cu_q_lens[-1] (bucket
    padding) and rows of zero-context sequences come out as zeros.
  """
  _check_inputs(q, k_cache, v_cache, block_tables, context_lens, cu_q_lens)
  _check_window_softcap(window, softcap)
  num_tokens, num_q_heads, head_dim = q.shape
  num_blocks, page_size, num_kv_heads, _ = k_cache.shape
  num_seqs, max_blocks_per_seq = block_tables.shape
  # Triton tensors have power-of-two sizes; padding the cache per call would
  # copy all of it, so these are the caller's job.
  if not is_power_of_two(page_size):
    raise ValueError(f"k_cache block_size must be a power of two, got {page_size}")
  if not is_power_of_two(head_dim) or head_dim < 16:
    raise ValueError(f"q head_dim must be a power of two >= 16 for the kernel, got {head_dim}")
  group = num_q_heads // num_kv_heads
  heads_pad = next_power_of_two(group)
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  if num_tokens == 0:
    return jnp.zeros_like(q)
  block_q, pages_per_step, num_splits, num_work = _resolve_block_sizes(
      block_sizes, decode_only=cu_q_lens is None, heads_pad=heads_pad, page_size=page_size,
      num_tokens=num_tokens, num_seqs=num_seqs, num_kv_heads=num_kv_heads,
      max_blocks_per_seq=max_blocks_per_seq)
  rows = max(16, block_q * heads_pad)

  context_lens = context_lens.astype(jnp.int32)
  if cu_q_lens is None:
    cu_q = jnp.arange(num_seqs + 1, dtype=jnp.int32)
  else:
    cu_q = cu_q_lens.astype(jnp.int32)
  items = _work_items(cu_q, context_lens, num_work, block_q)

  # Pad the table so every pages_per_step-wide slice is in bounds.
  padded_blocks = -(-max_blocks_per_seq // pages_per_step) * pages_per_step
  tables = block_tables.astype(jnp.int32)
  if padded_blocks != max_blocks_per_seq:
    tables = jnp.pad(tables, ((0, 0), (0, padded_blocks - max_blocks_per_seq)))

  # Gather each work item's queries into [num_work, num_kv_heads, rows, head_dim].
  row = jnp.arange(rows, dtype=jnp.int32)
  token_in_tile = row // heads_pad
  head_in_group = jnp.minimum(row % heads_pad, group - 1)
  tokens = jnp.clip(items["first_token"][:, None] + token_in_tile[None, :], 0, num_tokens - 1)
  heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[:, None] * group + head_in_group[None, :]
  q_tiles = q[tokens[:, None, :], heads[None, :, :]]  # [num_work, num_kv_heads, rows, head_dim]

  kernel = functools.partial(
      _paged_kernel, scale_log2=float(sm_scale) * LOG2_E, heads_pad=heads_pad,
      page_size=page_size, pages_per_compute_block=pages_per_step, num_splits=num_splits,
      window=window, softcap=softcap)
  # The pools are passed whole (memory space ANY): a per-head block would be staged as a copy of
  # a quarter of the pool per program in interpret mode, and the kernel needs no staging anyway.
  cache_spec = pl.BlockSpec(memory_space=pl.ANY)
  if num_splits == 1:
    out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda w, h, s: (w, h, 0, 0))
    out_shape = jax.ShapeDtypeStruct((num_work, num_kv_heads, rows, head_dim), q.dtype)
  else:
    out_specs = [
        pl.BlockSpec((None, None, None, rows, head_dim), lambda w, h, s: (w, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda w, h, s: (w, h, s, 0)),
        pl.BlockSpec((None, None, None, rows), lambda w, h, s: (w, h, s, 0)),
    ]
    part = (num_work, num_kv_heads, num_splits, rows)
    out_shape = [jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                 jax.ShapeDtypeStruct(part, jnp.float32),
                 jax.ShapeDtypeStruct(part, jnp.float32)]
  compiler_params = None
  if not interpret:
    compiler_params = triton_compiler_params(block_sizes.num_warps if block_sizes else None,
                                     block_sizes.num_stages if block_sizes else None)
  out = pl.pallas_call(
      kernel,
      grid=(num_work, num_kv_heads, num_splits),
      in_specs=[
          full_spec((num_work,)), full_spec((num_work,)), full_spec((num_work,)),
          full_spec(tables.shape),
          pl.BlockSpec((None, None, rows, head_dim), lambda w, h, s: (w, h, 0, 0)),
          cache_spec,
          cache_spec,
      ],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=compiler_params,
      interpret=interpret,
      name="paged_attention",
  )(items["seq"], items["first_pos"], items["kv_len"], tables, q_tiles, k_cache, v_cache)

  if num_splits > 1:
    acc, m, l = out  # [W, H, splits, rows, D], [W, H, splits, rows] x2
    m_max = jnp.max(m, axis=2, keepdims=True)
    weight = jnp.exp2(m - m_max)
    total = jnp.sum(l * weight, axis=2)
    total = jnp.where(total == 0.0, 1.0, total)
    out = (jnp.sum(acc * weight[..., None], axis=2) / total[..., None]).astype(q.dtype)

  # Scatter back: token t of sequence s is row (i % block_q) * heads_pad + g of
  # work item tile_start[s] + i // block_q, where i = t - cu_q[s].
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  tok_seq = jnp.clip(jnp.searchsorted(cu_q, t, side="right") - 1, 0, num_seqs - 1)
  i = t - cu_q[tok_seq]
  tok_work = jnp.clip(items["tile_start"][tok_seq] + i // block_q, 0, num_work - 1)
  hq = jnp.arange(num_q_heads, dtype=jnp.int32)
  tok_row = (i % block_q)[:, None] * heads_pad + (hq % group)[None, :]
  result = out[tok_work[:, None], (hq // group)[None, :], tok_row]  # [T, Hq, D]
  valid = (t >= cu_q[0]) & (t < cu_q[-1]) & (context_lens[tok_seq] > 0)
  return jnp.where(valid[:, None, None], result, jnp.zeros_like(result))


# ---------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("sm_scale", "window", "softcap"))
def paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, cu_q_lens=None,
                              *, sm_scale: float | None = None, window: int | None = None,
                              softcap: float | None = None):
  """Gathers each sequence's blocks and runs masked softmax attention in f32."""
  _check_inputs(q, k_cache, v_cache, block_tables, context_lens, cu_q_lens)
  _check_window_softcap(window, softcap)
  num_tokens, num_q_heads, head_dim = q.shape
  num_blocks, page_size, num_kv_heads, _ = k_cache.shape
  num_seqs, max_blocks_per_seq = block_tables.shape
  group = num_q_heads // num_kv_heads
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  if num_tokens == 0:
    return jnp.zeros_like(q)
  context_lens = context_lens.astype(jnp.int32)
  cu_q = (jnp.arange(num_seqs + 1, dtype=jnp.int32) if cu_q_lens is None
          else cu_q_lens.astype(jnp.int32))
  max_len = max_blocks_per_seq * page_size
  key_pos = jnp.arange(max_len, dtype=jnp.int32)
  page_of_key = key_pos // page_size

  t = jnp.arange(num_tokens, dtype=jnp.int32)
  tok_seq = jnp.clip(jnp.searchsorted(cu_q, t, side="right") - 1, 0, num_seqs - 1)
  valid = (t >= cu_q[0]) & (t < cu_q[-1])
  q_len = cu_q[tok_seq + 1] - cu_q[tok_seq]
  pos = context_lens[tok_seq] - q_len + (t - cu_q[tok_seq])  # [T]
  mask = (key_pos[None, :] <= pos[:, None]) & valid[:, None]  # [T, max_len]
  if window is not None:
    mask &= key_pos[None, :] > pos[:, None] - window
  # Indices of keys that are masked out are replaced by block 0 so that garbage
  # table slots are never followed, and the gathered values are zeroed too.
  blocks = jnp.where(mask, block_tables[tok_seq][:, page_of_key], 0)
  blocks = jnp.clip(blocks, 0, num_blocks - 1)
  slots = key_pos % page_size
  k = k_cache[blocks, slots[None, :]].astype(jnp.float32)  # [T, max_len, Hkv, D]
  v = v_cache[blocks, slots[None, :]].astype(jnp.float32)
  k = jnp.where(mask[:, :, None, None], k, 0.0)
  v = jnp.where(mask[:, :, None, None], v, 0.0)
  qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
  hi = lax.Precision.HIGHEST
  s = jnp.einsum("thgd,tkhd->thgk", qg, k, precision=hi) * sm_scale
  if softcap is not None:
    s = jnp.tanh(s / softcap) * softcap
  s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(mask[:, None, None, :], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0.0, 1.0, denom)
  out = jnp.einsum("thgk,tkhd->thgd", p, v, precision=hi)
  return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
