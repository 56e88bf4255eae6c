"""The grouped-matmul kernel (mixture-of-experts products) in the Pallas interpreter on CPU, against
its one-hot jnp reference and against jax.lax.ragged_dot; and the backend entry point the expert
op calls (runtime.worker.kernels.grouped_matmul)."""

import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import grouped_matmul, grouped_matmul_reference
from pallas_kernels.grouped_matmul import BlockSizes, resolve_block_sizes
from pallas_kernels.testing import tolerance
from runtime.worker import cpp_kernels, kernels

INTERPRET = True
SMALL = BlockSizes(block_m=16, block_n=16, block_k=16)


def _inputs(seed, group_sizes, num_rows, k, n, dtype, poison_tail=True):
  """lhs [num_rows, k], rhs [G, k, n], sizes; rows past the groups hold nan (poison_tail), so a
  kernel that lets them into any product shows it."""
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((num_rows, k)).astype(np.float32)
  if poison_tail:
    lhs[min(sum(group_sizes), num_rows):] = np.nan
  rhs = rng.standard_normal((len(group_sizes), k, n)).astype(np.float32)
  return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(group_sizes, jnp.int32)


def _check(out, lhs, rhs, sizes):
  """out against the reference and ragged_dot; the rows in no group are exact zeros."""
  dtype = lhs.dtype
  num_valid = min(int(np.sum(np.asarray(sizes))), lhs.shape[0])
  out = np.asarray(out.astype(jnp.float32))
  assert out.shape == (lhs.shape[0], rhs.shape[2])
  ref = np.asarray(grouped_matmul_reference(lhs, rhs, sizes).astype(jnp.float32))
  np.testing.assert_allclose(out[:num_valid], ref[:num_valid], **tolerance(dtype))
  np.testing.assert_array_equal(out[num_valid:], 0.0)
  # ragged_dot, nan tail and all: it too gives zeros for rows in no group.
  rd = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(out, np.asarray(rd), **tolerance(dtype))


# f32 products at full precision: the f32 tolerance is for the algorithm (ragged_dot's default
# precision on some backends is lower).
@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


# (group sizes, rows): empty experts at the front, middle and end; one group holding every row;
# boundaries off the 16-row tiles; fewer grouped rows than M (the bucket's padding); a sum past M
# (clipped, as ragged_dot does); a tile holding many small groups; K and N not multiples of 16.
CASES = {
    "ragged-empty-experts": ([0, 5, 0, 17, 3, 0, 9, 0], 40, 48, 32),
    "all-rows-one-group": ([0, 0, 37, 0], 37, 32, 48),
    "tail-past-groups": ([7, 0, 12], 50, 32, 32),
    "many-groups-one-tile": ([1, 2, 0, 1, 3, 1, 1, 0, 2, 1], 16, 16, 16),
    "sum-past-rows": ([10, 20, 30], 35, 16, 32),
    "odd-k-and-n": ([9, 4, 11], 24, 40, 24),
}


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference_and_ragged_dot_f32(name):
  sizes, rows, k, n = CASES[name]
  lhs, rhs, gs = _inputs(list(CASES).index(name), sizes, rows, k, n, jnp.float32,
                         poison_tail=sum(sizes) < rows)
  _check(grouped_matmul(lhs, rhs, gs, block_sizes=SMALL, interpret=INTERPRET), lhs, rhs, gs)


@pytest.mark.parametrize("block_sizes", [None, BlockSizes(block_m=32, block_n=32, block_k=32)],
                         ids=["default-blocks", "32-blocks"])
def test_kernel_bf16_and_block_sizes(block_sizes):
  # bf16 in, f32 accumulation, bf16 out; 70 rows (not a tile multiple) in 6 groups, one empty.
  lhs, rhs, gs = _inputs(3, [11, 0, 23, 5, 17, 9], 70, 64, 96, jnp.bfloat16)
  out = grouped_matmul(lhs, rhs, gs, block_sizes=block_sizes, interpret=INTERPRET)
  assert out.dtype == jnp.bfloat16
  _check(out, lhs, rhs, gs)


def test_kernel_preferred_element_type_and_all_groups_empty():
  lhs, rhs, gs = _inputs(4, [0, 0, 0], 20, 16, 16, jnp.bfloat16)
  out = grouped_matmul(lhs, rhs, gs, block_sizes=SMALL, preferred_element_type=jnp.float32,
                       interpret=INTERPRET)
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_reference_is_a_loop_over_groups():
  # The one-hot reference against the plainest numpy loop, with an empty group and a short tail.
  sizes = [3, 0, 4, 2]
  lhs, rhs, gs = _inputs(5, sizes, 12, 8, 5, jnp.float32, poison_tail=False)
  expected = np.zeros((12, 5))
  start = 0
  for g, size in enumerate(sizes):
    expected[start:start + size] = np.asarray(lhs, np.float64)[start:start + size] @ np.asarray(rhs[g], np.float64)
    start += size
  np.testing.assert_allclose(np.asarray(grouped_matmul_reference(lhs, rhs, gs)), expected,
                             **tolerance(jnp.float32))


def test_block_sizes_fit_the_weights_without_copies():
  # Qwen3-MoE's expert shapes divide the tiles: nothing padded. A tiny model's 40 pads. The rows
  # per tile follow the rows per expert: 16 at a 64-token top-4 decode step over 64 experts, 64 at
  # a 512-token prefill.
  assert resolve_block_sizes(None, 256, 64, 2048, 768) == (16, 128, 64, 2048, 768)
  assert resolve_block_sizes(None, 2048, 64, 768, 2048) == (32, 128, 64, 768, 2048)
  assert resolve_block_sizes(None, 4096, 8, 768, 2048) == (64, 128, 64, 768, 2048)
  assert resolve_block_sizes(BlockSizes(block_m=128, block_n=256), 200, 2, 96, 48) == (128, 16, 32, 96, 48)
  assert resolve_block_sizes(None, 8, 4, 40, 8) == (16, 16, 16, 48, 16)
  for bad in (dict(block_m=8), dict(block_n=48), dict(block_k=0), dict(num_warps=3)):
    with pytest.raises(ValueError, match="BlockSizes"):
      BlockSizes(**bad)


def test_bad_inputs_are_clear_errors():
  lhs, rhs, gs = _inputs(6, [2, 2], 4, 16, 16, jnp.float32, poison_tail=False)
  with pytest.raises(ValueError, match="K=16"):
    grouped_matmul(lhs[:, :8], rhs, gs, interpret=True)
  with pytest.raises(ValueError, match="num_groups"):
    grouped_matmul(lhs, rhs, gs[:1], interpret=True)
  with pytest.raises(ValueError, match="one dtype"):
    grouped_matmul(lhs, rhs.astype(jnp.bfloat16), gs, interpret=True)
  with pytest.raises(ValueError, match="integer"):
    grouped_matmul(lhs, rhs, gs.astype(jnp.float32), interpret=True)


@pytest.mark.parametrize("cpp", [False, True], ids=["xla", "cpp"])
@pytest.mark.parametrize("name", CASES)
def test_cpu_tile_loop(name, cpp):
  # The XLA:CPU form the xla and cpp backends run, on every kernel case; under cpp each tile's
  # product in our C++ row kernel, reading the group's matrix in place.
  if cpp and not cpp_kernels.matmul_vectorized():
    pytest.skip("the C++ row kernels' vector path (AVX-512BW) is not on this CPU")
  sizes, rows, k, n = CASES[name]
  lhs, rhs, gs = _inputs(list(CASES).index(name), sizes, rows, k, n, jnp.float32,
                         poison_tail=sum(sizes) < rows)
  tiles = jax.jit(functools.partial(kernels.grouped_matmul_tiles, cpp=cpp))
  _check(tiles(lhs, rhs, gs), lhs, rhs, gs)


def test_cpu_tile_loop_wide_tiles():
  # 300 rows in 3 groups: 128-row tiles (GMM_MAX_TILE), each group's last tile short of its end.
  lhs, rhs, gs = _inputs(9, [130, 0, 101, 60], 300, 16, 16, jnp.float32)
  _check(jax.jit(kernels.grouped_matmul_tiles)(lhs, rhs, gs), lhs, rhs, gs)


def test_kernel_lowers_for_cuda_through_triton_without_copying_the_weights():
  # No GPU here, but the kernel lowers for one: a Triton custom call (not Mosaic GPU), at Qwen3-MoE's
  # expert shapes (a 64-token top-4 decode step's gate/up product), and nothing is padded: the
  # expert weights reach the kernel as they are.
  lhs = jax.ShapeDtypeStruct((256, 2048), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((64, 2048, 1536), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((64,), jnp.int32)
  fn = jax.jit(lambda a, b, c: kernels.grouped_matmul(a, b, c, backend="pallas"))
  text = fn.trace(lhs, rhs, sizes).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
  assert "mosaic" not in text.lower() and "stablehlo.pad" not in text
  assert "grid_x = 16 : i32, grid_y = 12 : i32" in text  # 16-row tiles x 128-column tiles


@pytest.mark.parametrize("backend", ["xla", "cpp", "interpret"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backend_entry_point(backend, dtype):
  # The expert op's entry: the tile loop under xla/cpp on CPU, our kernel under interpret.
  lhs, rhs, gs = _inputs(7, [0, 9, 0, 14, 2], 32, 32, 16, dtype)
  out = jax.jit(lambda a, b, c: kernels.grouped_matmul(a, b, c, backend=backend))(lhs, rhs, gs)
  assert out.dtype == dtype
  _check(out, lhs, rhs, gs)


@pytest.mark.parametrize("backend", ["xla", "cpp", "interpret"])
def test_backend_entry_point_reads_a_layer_of_a_stack(backend):
  # A scanned step passes every layer's experts [L, G, K, N] and a traced layer index: the same
  # result as that layer's own [G, K, N].
  lhs, rhs, gs = _inputs(10, [5, 0, 11, 3], 24, 16, 32, jnp.float32)
  stack = jnp.stack([rhs * 0.5, rhs, -rhs])
  fn = jax.jit(lambda a, b, c, i: kernels.grouped_matmul(a, b, c, backend=backend, layer=i))
  for i in (1, 2):
    out = fn(lhs, stack, gs, jnp.int32(i))
    _check(out, lhs, stack[i], gs)


def test_backend_entry_point_errors():
  lhs, rhs, gs = _inputs(8, [2, 2], 4, 16, 16, jnp.float32, poison_tail=False)
  with pytest.raises(ValueError, match="unknown kernel backend"):
    kernels.grouped_matmul(lhs, rhs, gs, backend="tpu")
  with pytest.raises(ValueError, match="one dtype"):
    kernels.grouped_matmul(lhs, rhs.astype(jnp.bfloat16), gs, backend="xla")
  with pytest.raises(ValueError, match="needs rhs"):
    kernels.grouped_matmul(lhs, rhs, gs, backend="cpp", layer=0)


def test_moe_layer_harness_checks_grouped_against_dense(capsys):
  # benchmarks/moe_layer.py at a tiny shape: the grouped layer (the engine's moe_experts lowering:
  # sort, grouped products, unsort, combine) must equal every expert run densely before anything is timed.
  path = Path(__file__).resolve().parents[1] / "benchmarks" / "moe_layer.py"
  spec = importlib.util.spec_from_file_location("moe_layer", path)
  harness = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(harness)
  args = ["--experts", "8", "--top-k", "2", "--rows", "12", "--hidden", "32", "--intermediate", "16",
          "--repeats", "1", "--rounds", "1"]
  assert harness.main(args) == 0
  out = capsys.readouterr().out
  forms = ["grouped[xla]"]
  forms += ["grouped[cpp]"] if cpp_kernels.matmul_vectorized() else []
  for form in forms:
    assert f'"form": "{form}", "max_abs_diff_vs_dense"' in out and f'"form": "{form}", "ms"' in out
  assert '"ratio_vs_dense"' in out
  with pytest.raises(SystemExit):
    harness.main(args + ["--products", "pallas"])  # off a GPU: refused, not a Triton crash
