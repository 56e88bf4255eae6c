"""Grouped matmul (the mixture-of-experts product) as a Pallas kernel, with a jnp reference.

The contract is `jax.lax.ragged_dot`'s: lhs [M, K] holds rows sorted by group, group g owns
rows [offsets[g], offsets[g + 1]) where offsets = [0, cumsum(group_sizes)], and its rows are
multiplied by rhs[g] [K, N]. Rows past sum(group_sizes) come out as zeros; offsets past M are
clipped to M (rows that do not exist are not computed).

Work decomposition: the grid is (row tiles of block_m, column tiles of block_n). Before the
kernel, a jnp prologue finds, for every row tile, the first and one-past-last group that owns
one of its rows. The program loops over those groups; a tile that straddles a group boundary
is therefore visited once per group it holds, each time with a row mask that keeps only that
group's rows (megablox-style), and an empty group in the range costs no product (its K loop has
zero trips). Products accumulate in f32 in one [block_m, block_n] accumulator, and every output
tile is written once, by one program: no two programs write the same rows.

Layout of the three parts, as in JAX's own Pallas ops: the kernel body, the public jitted
wrapper with keyword-only tuning knobs, and a jnp reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._util import (full_spec, is_int, is_power_of_two, multiple_of,
                                  triton_compiler_params)

# The smallest tile side: tl.dot needs every dimension >= 16.
_MIN_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes for `grouped_matmul`.

  block_m: rows of lhs per program (power of two >= 16). None picks the next power of two of the
    average rows per group, between 16 and 64: a tile then holds about one group's rows, and a
    decode step's few rows per expert (64 tokens x top-4 over 64 experts: 4) get short tiles and
    many programs rather than a few tall tiles that each loop over a dozen groups.
  block_n: output columns per program; block_k: the contraction step. Powers of two >= 16. If
    N (or K) is not a multiple of the requested size, the largest power of two >= 16 that
    divides it is used instead, so expert weights are never copied to pad them; only a dim that
    is not a multiple of 16 (tiny test models) is padded, to the next multiple of 16.
  num_warps / num_stages: Triton settings on GPU (None keeps Pallas' defaults), ignored in
    interpret mode.
  """

  block_m: int | None = None
  block_n: int = 128
  block_k: int = 64
  num_warps: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      value = getattr(self, name)
      if value is None and name == "block_m":
        continue
      if not is_power_of_two(value) or value < _MIN_BLOCK:
        raise ValueError(
            f"BlockSizes.{name} must be a power of two >= {_MIN_BLOCK} (Triton needs "
            f"power-of-two tiles and dot operands of at least 16), got {value!r}")
    for name in ("num_warps", "num_stages"):
      value = getattr(self, name)
      if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"BlockSizes.{name} must be None or a positive int, got {value!r}")
    if self.num_warps is not None and not is_power_of_two(self.num_warps):
      raise ValueError(f"BlockSizes.num_warps must be a power of two, got {self.num_warps!r}")


# ---------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------


def _gmm_kernel(group_lo_ref, group_hi_ref, offsets_ref, lhs_ref, rhs_ref, o_ref, *,
                block_m: int, block_k: int, num_k_blocks: int):
  # group_lo_ref: [num_m_tiles] int32  first group owning a row of each row tile
  # group_hi_ref: [num_m_tiles] int32  one past the last such group (lo == hi: no rows)
  # offsets_ref:  [num_groups + 1] int32  group g owns rows [offsets[g], offsets[g + 1])
  # lhs_ref:      [block_m, padded_k]  this program's rows
  # rhs_ref:      [num_groups, padded_k, block_n]  every group's weights, this column tile
  # o_ref:        [block_m, block_n]
  m_tile = pl.program_id(0)
  block_n = o_ref.shape[-1]
  rows = m_tile * block_m + lax.broadcasted_iota(jnp.int32, (block_m,), 0)

  def group_body(g, acc):
    start = offsets_ref[g]
    end = offsets_ref[g + 1]
    mine = ((rows >= start) & (rows < end))[:, None]  # [block_m, 1]
    # An empty group (an expert no token chose) runs no product at all.
    k_steps = jnp.where(end > start, num_k_blocks, 0)

    def k_body(kb, acc):
      k0 = multiple_of(kb * block_k, block_k)
      x = lhs_ref[:, pl.ds(k0, block_k)]  # [block_m, block_k]
      # Rows of other groups may hold anything (even nan): zero them, not only their product.
      x = jnp.where(mine, x, jnp.zeros_like(x))
      w = rhs_ref[g, pl.ds(k0, block_k), :]  # [block_k, block_n]
      return acc + lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)

    return lax.fori_loop(0, k_steps, k_body, acc)

  acc = jnp.zeros((block_m, block_n), jnp.float32)
  acc = lax.fori_loop(group_lo_ref[m_tile], group_hi_ref[m_tile], group_body, acc)
  o_ref[...] = acc.astype(o_ref.dtype)


# ---------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_inputs(lhs, rhs, group_sizes):
  """ValueError unless the shapes and dtypes fit `grouped_matmul`'s contract."""
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be [rows, K], got shape {lhs.shape}")
  if rhs.ndim != 3:
    raise ValueError(f"rhs must be [num_groups, K, N], got shape {rhs.shape}")
  if rhs.shape[1] != lhs.shape[1]:
    raise ValueError(f"rhs has K={rhs.shape[1]} but lhs has K={lhs.shape[1]}")
  if group_sizes.shape != (rhs.shape[0],):
    raise ValueError(f"group_sizes must be [num_groups] = [{rhs.shape[0]}], got shape "
                     f"{group_sizes.shape}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be an integer array, got {group_sizes.dtype}")
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if x.dtype not in FLOAT_DTYPES:
      raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"lhs and rhs must have one dtype, got lhs {lhs.dtype}, rhs {rhs.dtype}")


def group_offsets(group_sizes, num_rows: int):
  """[num_groups + 1] int32 row offsets of the groups, clipped to the rows there are."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return jnp.minimum(jnp.concatenate([jnp.zeros((1,), jnp.int32), ends]), num_rows)


def _tile_groups(offsets, num_m_tiles: int, block_m: int):
  """Per row tile: [first, one past last) group owning one of its rows (first == last: none)."""
  ends = offsets[1:]
  total = offsets[-1]
  tile_start = jnp.arange(num_m_tiles, dtype=jnp.int32) * block_m
  tile_last = jnp.minimum(tile_start + block_m, total) - 1  # last row of the tile in any group
  # The group holding row r is the first whose end exceeds r (empty groups end where they start).
  lo = jnp.searchsorted(ends, tile_start, side="right").astype(jnp.int32)
  hi = jnp.searchsorted(ends, tile_last, side="right").astype(jnp.int32) + 1
  hi = jnp.where(tile_start < total, hi, lo)
  return lo, hi


def _fit_block(dim: int, requested: int) -> tuple[int, int]:
  """(block, padded dim): the largest power of two >= 16 and <= requested that divides dim; a dim
  with none (not a multiple of 16) is padded up to a multiple of 16 first."""
  padded = -(-dim // _MIN_BLOCK) * _MIN_BLOCK
  block = requested
  while padded % block:
    block //= 2
  return block, padded


def resolve_block_sizes(block_sizes: BlockSizes | None, num_rows: int, num_groups: int, k: int,
                        n: int):
  """(block_m, block_n, block_k, padded_k, padded_n) used for these shapes."""
  if block_sizes is None:
    block_sizes = BlockSizes()
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a grouped_matmul.BlockSizes, got {block_sizes!r}")
  block_m = block_sizes.block_m
  if block_m is None:
    rows_per_group = -(-num_rows // max(1, num_groups))
    block_m = min(64, max(_MIN_BLOCK, 1 << max(0, (rows_per_group - 1).bit_length())))
  block_n, padded_n = _fit_block(n, block_sizes.block_n)
  block_k, padded_k = _fit_block(k, block_sizes.block_k)
  return block_m, block_n, block_k, padded_k, padded_n


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "preferred_element_type"))
def grouped_matmul(lhs, rhs, group_sizes, *, block_sizes: BlockSizes | None = None,
                   interpret: bool = False, preferred_element_type=None):
  """Rows of lhs, sorted by group, times their group's matrix (jax.lax.ragged_dot's contract).

  Args:
    lhs: [M, K] rows sorted by group.
    rhs: [G, K, N] one matrix per group; lhs's dtype (float32, bfloat16 or float16).
    group_sizes: int [G] rows per group; group g owns rows [sum(sizes[:g]), sum(sizes[:g+1])).
      Empty groups are allowed. Rows past sum(group_sizes) come out as zeros; a sum past M is
      clipped to M.
    block_sizes: `BlockSizes` tiling.
    interpret: run the Pallas interpreter (CPU tests).
    preferred_element_type: output dtype (default lhs's); products accumulate in f32 either way.

  Returns:
    [M, N].
  """
  check_inputs(lhs, rhs, group_sizes)
  out_dtype = lhs.dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
  num_rows, k = lhs.shape
  num_groups, _, n = rhs.shape
  if num_rows == 0 or n == 0 or num_groups == 0:
    return jnp.zeros((num_rows, n), out_dtype)
  block_m, block_n, block_k, padded_k, padded_n = resolve_block_sizes(
      block_sizes, num_rows, num_groups, k, n)
  num_m_tiles = -(-num_rows // block_m)
  padded_m = num_m_tiles * block_m
  # Padding keeps every pl.ds load in bounds (Triton does no bounds checks). Zero K columns add
  # nothing to a product; padded rows and columns are sliced off below.
  if (padded_m, padded_k) != lhs.shape:
    lhs = jnp.pad(lhs, ((0, padded_m - num_rows), (0, padded_k - k)))
  if (padded_k, padded_n) != rhs.shape[1:]:
    rhs = jnp.pad(rhs, ((0, 0), (0, padded_k - k), (0, padded_n - n)))
  offsets = group_offsets(group_sizes, num_rows)
  group_lo, group_hi = _tile_groups(offsets, num_m_tiles, block_m)

  kernel = functools.partial(_gmm_kernel, block_m=block_m, block_k=block_k,
                             num_k_blocks=padded_k // block_k)
  compiler_params = None
  if not interpret:
    blocks = block_sizes or BlockSizes()
    compiler_params = triton_compiler_params(blocks.num_warps, blocks.num_stages)
  out = pl.pallas_call(
      kernel,
      grid=(num_m_tiles, padded_n // block_n),
      in_specs=[
          full_spec((num_m_tiles,)), full_spec((num_m_tiles,)), full_spec((num_groups + 1,)),
          pl.BlockSpec((block_m, padded_k), lambda i, j: (i, 0)),
          pl.BlockSpec((num_groups, padded_k, block_n), lambda i, j: (0, 0, j)),
      ],
      out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((padded_m, padded_n), out_dtype),
      compiler_params=compiler_params,
      interpret=interpret,
      name="grouped_matmul",
  )(group_lo, group_hi, offsets, lhs, rhs)
  return out[:num_rows, :n]


# ---------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("preferred_element_type",))
def grouped_matmul_reference(lhs, rhs, group_sizes, *, preferred_element_type=None):
  """Every row against every group's matrix in f32, the row's own group picked by a one-hot mask
  (rows in no group pick nothing): the semantics of `grouped_matmul`, obviously."""
  check_inputs(lhs, rhs, group_sizes)
  out_dtype = lhs.dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
  offsets = group_offsets(group_sizes, lhs.shape[0])
  rows = jnp.arange(lhs.shape[0], dtype=jnp.int32)
  one_hot = (rows[:, None] >= offsets[None, :-1]) & (rows[:, None] < offsets[None, 1:])  # [M, G]
  per_group = jnp.einsum("mk,gkn->mgn", lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                         precision=lax.Precision.HIGHEST)
  # A select, not a product with the mask: rows in no group may hold nan, and 0 * nan is nan.
  out = jnp.sum(jnp.where(one_hot[:, :, None], per_group, 0.0), axis=1)
  return out.astype(out_dtype)
