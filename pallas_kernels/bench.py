"""Benchmark of the attention kernels against XLA, cuDNN and JAX's shipped Pallas op.

    python -m pallas_kernels.bench               # on a GPU
    python -m pallas_kernels.bench --interpret   # tiny shapes on CPU, a smoke test

Prints three tables:
  * device ceilings measured in the same run: a large copy (GB/s) and a large
    bf16 matmul (TFLOP/s);
  * prefill: causal GQA attention TFLOP/s of `flash_attention` vs
    `jax.nn.dot_product_attention` (xla, cudnn) and JAX's Pallas `mha` (a
    baseline only, never used by the engine), as a fraction of the matmul
    ceiling;
  * decode: GB/s (K/V bytes read + q + out) of `paged_attention` vs
    `jax.nn.dot_product_attention` on the same KV gathered into a contiguous
    cache, as a fraction of the copy ceiling.

Times are medians over `--repeats` calls, each ending in block_until_ready.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from typing import Callable

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import BlockSizes as FlashBlockSizes
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.paged_attention import BlockSizes as PagedBlockSizes
from pallas_kernels.paged_attention import paged_attention

# Skip an implementation whose temporaries would exceed this (the xla path
# materializes the full [B, H, L, L] logits).
_MAX_TEMP_BYTES = 24 << 30


@dataclasses.dataclass(frozen=True)
class PrefillCase:
  batch: int
  seq_len: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int

  @property
  def name(self) -> str:
    return (f"B={self.batch} L={self.seq_len} H={self.num_q_heads}/{self.num_kv_heads} "
            f"D={self.head_dim}")

  @property
  def flops(self) -> float:
    # Two matmuls of 2*L*L*D flops per head, halved by the causal mask.
    return 4.0 * self.batch * self.seq_len**2 * self.num_q_heads * self.head_dim / 2


@dataclasses.dataclass(frozen=True)
class DecodeCase:
  num_seqs: int
  context_len: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  block_size: int = 16

  @property
  def name(self) -> str:
    return (f"S={self.num_seqs} ctx={self.context_len} H={self.num_q_heads}/"
            f"{self.num_kv_heads} D={self.head_dim}")

  def bytes_moved(self, itemsize: int) -> float:
    kv = 2 * self.num_seqs * self.context_len * self.num_kv_heads * self.head_dim
    q_and_out = 2 * self.num_seqs * self.num_q_heads * self.head_dim
    return float((kv + q_and_out) * itemsize)


@dataclasses.dataclass
class Row:
  table: str
  case: str
  impl: str
  seconds: float | None
  rate: float | None  # TFLOP/s or GB/s
  fraction: float | None
  note: str = ""


def _median_seconds(fn: Callable[[], jax.Array], repeats: int) -> float:
  jax.block_until_ready(fn())  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _short_error(err: Exception) -> str:
  text = str(err).strip().splitlines()
  return f"{type(err).__name__}: {text[0][:60] if text else ''}"


def measure_ceilings(*, small: bool, repeats: int) -> dict[str, float]:
  """Copy bandwidth (GB/s, read + write) and bf16 matmul throughput (TFLOP/s)."""
  n = (1 << 20) if small else (1 << 30)  # elements; 2 GiB of bf16 on a GPU
  copy = jax.jit(lambda a: a + jnp.bfloat16(1))
  t_copy = _median_seconds(functools.partial(copy, jnp.ones((n,), jnp.bfloat16)), repeats)
  m = 256 if small else 8192
  # Random operands: all-ones matmuls draw less power and can clock higher.
  key_a, key_b = jax.random.split(jax.random.key(0))
  a = jax.random.normal(key_a, (m, m), jnp.bfloat16)
  b = jax.random.normal(key_b, (m, m), jnp.bfloat16)
  matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
  t_mm = _median_seconds(functools.partial(matmul, a, b), repeats)
  return {"copy_gbps": 2 * n * 2 / t_copy / 1e9, "copy_s": t_copy,
          "matmul_tflops": 2 * m**3 / t_mm / 1e12, "matmul_s": t_mm}


def _prefill_impls(case: PrefillCase, *, interpret: bool, flash_blocks):
  rng = np.random.default_rng(0)
  dtype = jnp.bfloat16
  B, L, Hq, Hkv, D = (case.batch, case.seq_len, case.num_q_heads, case.num_kv_heads,
                      case.head_dim)
  q = jnp.asarray(rng.standard_normal((B, L, Hq, D)), dtype)
  k = jnp.asarray(rng.standard_normal((B, L, Hkv, D)), dtype)
  v = jnp.asarray(rng.standard_normal((B, L, Hkv, D)), dtype)
  scale = 1.0 / np.sqrt(D)
  impls = {}

  packed = [x.reshape(B * L, x.shape[2], D) for x in (q, k, v)]
  cu = jnp.arange(B + 1, dtype=jnp.int32) * L
  impls["ours (pallas)"] = lambda: flash_attention(
      *packed, cu, causal=True, sm_scale=scale, block_sizes=flash_blocks, interpret=interpret)

  logits_bytes = B * Hq * L * L * 4
  for impl in ("xla", "cudnn"):
    if impl == "xla" and logits_bytes > _MAX_TEMP_BYTES:
      impls[f"dot_product_attention[{impl}]"] = "skip: logits too large"
      continue
    fn = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, implementation=impl))
    impls[f"dot_product_attention[{impl}]"] = lambda fn=fn: fn(q, k, v)

  try:  # JAX's shipped Pallas kernel, as a baseline only.
    from jax.experimental.pallas.ops.gpu import attention as jax_pallas_attention  # noqa: PLC0415
    group = Hq // Hkv
    k_rep, v_rep = (jnp.repeat(x, group, axis=2) for x in (k, v))  # it has no GQA
    mha = jax.jit(lambda q, k, v: jax_pallas_attention.mha(
        q, k, v, None, sm_scale=scale, causal=True, interpret=interpret))
    impls["jax pallas mha (baseline)"] = lambda: mha(q, k_rep, v_rep)
  except Exception as err:  # noqa: BLE001 (any import/API drift just drops the baseline)
    impls["jax pallas mha (baseline)"] = f"unavailable: {_short_error(err)}"
  return impls


def _decode_impls(case: DecodeCase, *, interpret: bool, paged_blocks):
  rng = np.random.default_rng(1)
  dtype = jnp.bfloat16
  S, C, Hq, Hkv, D, P = (case.num_seqs, case.context_len, case.num_q_heads, case.num_kv_heads,
                         case.head_dim, case.block_size)
  pages = -(-C // P)
  num_blocks = S * pages + 1
  k_cache = jnp.asarray(rng.standard_normal((num_blocks, P, Hkv, D), np.float32), dtype)
  v_cache = jnp.asarray(rng.standard_normal((num_blocks, P, Hkv, D), np.float32), dtype)
  tables = jnp.asarray(rng.permutation(num_blocks)[:S * pages].reshape(S, pages), jnp.int32)
  context_lens = jnp.full((S,), C, jnp.int32)
  q = jnp.asarray(rng.standard_normal((S, Hq, D)), dtype)
  scale = 1.0 / np.sqrt(D)
  impls = {"ours (paged pallas)": lambda: paged_attention(
      q, k_cache, v_cache, tables, context_lens, sm_scale=scale, block_sizes=paged_blocks,
      interpret=interpret)}

  # The same data gathered once into a contiguous [S, ctx, Hkv, D] cache.
  def gather(cache):
    return cache[tables].reshape(S, pages * P, Hkv, D)[:, :C]
  k_contig, v_contig = jax.jit(gather)(k_cache), jax.jit(gather)(v_cache)
  q4 = q[:, None]
  for impl in ("xla", "cudnn"):
    fn = jax.jit(lambda q, k, v, lens, impl=impl: jax.nn.dot_product_attention(
        q, k, v, scale=scale, key_value_seq_lengths=lens, implementation=impl))
    impls[f"dot_product_attention[{impl}] contiguous"] = (
        lambda fn=fn: fn(q4, k_contig, v_contig, context_lens))
  return impls


def _run_impls(table, case_name, impls, repeats, to_rate, ceiling, *, ours, reference):
  """Times every implementation; notes ours' max abs difference from the reference."""
  rows, outputs = [], {}
  for impl, fn in impls.items():
    if isinstance(fn, str):
      rows.append(Row(table, case_name, impl, None, None, None, fn))
      continue
    try:
      seconds = _median_seconds(fn, repeats)
      outputs[impl] = fn()
    except Exception as err:  # noqa: BLE001 (e.g. cudnn absent: report, keep going)
      rows.append(Row(table, case_name, impl, None, None, None, _short_error(err)))
      continue
    rate = to_rate(seconds)
    rows.append(Row(table, case_name, impl, seconds, rate, rate / ceiling if ceiling else None))
  if ours in outputs and reference in outputs:
    a = np.asarray(outputs[ours], np.float32)
    b = np.asarray(outputs[reference], np.float32).reshape(a.shape)
    for row in rows:
      if row.impl == ours:
        row.note = f"max|diff| vs {reference.split()[0]}: {np.max(np.abs(a - b)):.2e}"
  return rows


def prefill_cases(small: bool) -> list[PrefillCase]:
  if small:
    return [PrefillCase(1, 64, 4, 2, 64), PrefillCase(2, 32, 4, 1, 128)]
  cases = []
  for head_dim, (hq, hkv) in ((64, (16, 4)), (128, (32, 8))):
    for batch in (1, 4, 16):
      for seq_len in (512, 2048, 8192):
        if batch * seq_len <= 65536:
          cases.append(PrefillCase(batch, seq_len, hq, hkv, head_dim))
  return cases


def decode_cases(small: bool) -> list[DecodeCase]:
  if small:
    return [DecodeCase(2, 40, 4, 2, 64), DecodeCase(1, 100, 8, 1, 128)]
  cases = []
  for num_seqs in (1, 16, 64, 256):
    for context_len in (128, 1024, 8192, 32768):
      if num_seqs * context_len <= (1 << 21):  # <= 8 GiB per bf16 cache
        cases.append(DecodeCase(num_seqs, context_len, 32, 8, 128))
  return cases


def format_table(rows: list[Row], rate_unit: str, fraction_of: str) -> str:
  header = ("case", "impl", "ms", rate_unit, f"of {fraction_of}", "note")
  lines = [header]
  for r in rows:
    lines.append((
        r.case, r.impl,
        "-" if r.seconds is None else f"{r.seconds * 1e3:.3f}",
        "-" if r.rate is None else f"{r.rate:.4g}",
        "-" if r.fraction is None else f"{100 * r.fraction:.1f}%",
        r.note))
  widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
  out = []
  for n, line in enumerate(lines):
    out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    if n == 0:
      out.append("  ".join("-" * w for w in widths))
  return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m pallas_kernels.bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--interpret", action="store_true",
                      help="tiny shapes, Pallas interpreter (CPU smoke test)")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed calls per measurement (default 10, 1 with --interpret)")
  parser.add_argument("--only", choices=("ceilings", "prefill", "decode"), action="append",
                      help="run only these parts (repeatable)")
  parser.add_argument("--block-q", type=int, default=None, help="flash_attention block_q")
  parser.add_argument("--block-kv", type=int, default=None, help="flash_attention block_kv")
  parser.add_argument("--num-splits", type=int, default=None, help="paged_attention num_splits")
  args = parser.parse_args(argv)
  small = args.interpret
  repeats = args.repeats or (1 if small else 10)
  parts = set(args.only or ("ceilings", "prefill", "decode"))

  flash_kwargs = {k: v for k, v in (("block_q", args.block_q), ("block_kv", args.block_kv))
                  if v is not None}
  flash_blocks = FlashBlockSizes(**flash_kwargs)
  paged_blocks = PagedBlockSizes(num_splits=args.num_splits)

  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"
        f", interpret={args.interpret}, repeats={repeats}")
  # Always measured: the fractions in the other tables are relative to these.
  ceilings = measure_ceilings(small=small, repeats=repeats)
  print(f"\nceilings: copy {ceilings['copy_gbps']:.1f} GB/s (read+write), "
          f"bf16 matmul {ceilings['matmul_tflops']:.1f} TFLOP/s")

  if "prefill" in parts:
    rows = []
    for case in prefill_cases(small):
      impls = _prefill_impls(case, interpret=args.interpret, flash_blocks=flash_blocks)
      rows += _run_impls("prefill", case.name, impls, repeats,
                         lambda s, case=case: case.flops / s / 1e12, ceilings["matmul_tflops"],
                         ours="ours (pallas)", reference="dot_product_attention[xla]")
    print("\nprefill (causal, GQA, bf16)")
    print(format_table(rows, "TFLOP/s", "matmul"))

  if "decode" in parts:
    rows = []
    for case in decode_cases(small):
      impls = _decode_impls(case, interpret=args.interpret, paged_blocks=paged_blocks)
      nbytes = case.bytes_moved(jnp.dtype(jnp.bfloat16).itemsize)
      rows += _run_impls("decode", case.name, impls, repeats,
                         lambda s, nbytes=nbytes: nbytes / s / 1e9, ceilings["copy_gbps"],
                         ours="ours (paged pallas)",
                         reference="dot_product_attention[xla] contiguous")
    print("\ndecode (one query per sequence, bf16, block_size 16)")
    print(format_table(rows, "GB/s", "copy"))
  sys.stdout.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
