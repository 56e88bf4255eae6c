"""Benchmark of our kernels against XLA, cuDNN and JAX's shipped Pallas op.

    python -m pallas_kernels.bench               # on a GPU
    python -m pallas_kernels.bench --interpret   # tiny shapes on CPU, a smoke test
    python -m pallas_kernels.bench --only decode --case-timeout-s 10 --max-seconds 120

Prints four tables:
  * device ceilings measured in the same run: a large copy (GB/s) and a large
    bf16 matmul (TFLOP/s);
  * prefill: causal GQA attention TFLOP/s of `flash_attention` vs
    `jax.nn.dot_product_attention` (xla, cudnn) and JAX's Pallas `mha` (a
    baseline only, never used by the engine), as a fraction of the matmul
    ceiling;
  * decode: GB/s (K/V bytes read + q + out) of `paged_attention` vs
    `jax.nn.dot_product_attention` on the same KV gathered into a contiguous
    cache, as a fraction of the copy ceiling;
  * grouped matmul (the expert products of a mixture-of-experts layer): GB/s (the weights of
    the experts that have rows + lhs + out) of `grouped_matmul` vs `jax.lax.ragged_dot`, as a
    fraction of the copy ceiling. `run()` measures it when asked (`parts`), the command always.

Every row is printed as soon as it is measured. Each row (one implementation on
one case) is bounded: its first call (compile + run) is timed, then up to
`--repeats` calls while `--case-timeout-s` lasts; the time is their median. An
implementation whose time, scaled from its previous case, would not fit that
budget is skipped with a note, and so is one whose temporaries would not fit
the device. `--max-seconds` bounds the whole run: rows not reached by then are
listed as skipped. A single call cannot be interrupted; a caller that must
survive a hung kernel runs this in a subprocess with a timeout (as
`python -m runtime.selfcheck` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Callable

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import BlockSizes as FlashBlockSizes
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.grouped_matmul import BlockSizes as GmmBlockSizes
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.paged_attention import BlockSizes as PagedBlockSizes
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.testing import tolerance

# Skip an implementation whose temporaries would exceed this (the xla path
# materializes the full [B, H, L, L] logits), or this fraction of the device's
# memory where the device reports it.
_MAX_TEMP_BYTES = 24 << 30
_MAX_TEMP_FRACTION = 0.4
# A case whose inputs (and their contiguous copies) exceed this fraction of the
# device's memory is skipped whole.
_MAX_INPUT_FRACTION = 0.6

OURS_PREFILL = "ours (pallas)"
OURS_DECODE = "ours (paged pallas)"
XLA_PREFILL = "dot_product_attention[xla]"
CUDNN_PREFILL = "dot_product_attention[cudnn]"
XLA_DECODE = "dot_product_attention[xla] contiguous"
CUDNN_DECODE = "dot_product_attention[cudnn] contiguous"
# cuDNN's rows where there is no NVIDIA GPU: said so, instead of JAX's "cuDNN is not detected".
CUDNN_NA = "n.a.: cuDNN needs an NVIDIA GPU"
MHA_PREFILL = "jax pallas mha (baseline)"
OURS_GMM = "ours (grouped pallas)"
XLA_GMM = "ragged_dot[xla]"


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


@dataclasses.dataclass(frozen=True)
class GmmCase:
  """Expert products of one MoE layer's step: `tokens` x `top_k` rows routed uniformly at random
  (a fixed seed) over `num_groups` experts of [k, n] weights."""
  tokens: int
  top_k: int
  num_groups: int
  k: int
  n: int

  @property
  def name(self) -> str:
    return f"T={self.tokens} top{self.top_k}/{self.num_groups} K={self.k} N={self.n}"

  def group_sizes(self) -> np.ndarray:
    rng = np.random.default_rng(self.tokens * 1000 + self.num_groups)
    experts = np.stack([rng.permutation(self.num_groups)[:self.top_k] for _ in range(self.tokens)])
    return np.bincount(experts.ravel(), minlength=self.num_groups).astype(np.int32)

  def bytes_moved(self, itemsize: int) -> float:
    used = int(np.count_nonzero(self.group_sizes()))
    rows = self.tokens * self.top_k
    return float((used * self.k * self.n + rows * (self.k + self.n)) * itemsize)


@dataclasses.dataclass
class Row:
  table: str
  case: str
  impl: str
  seconds: float | None  # median of the timed calls
  rate: float | None  # TFLOP/s or GB/s
  fraction: float | None
  note: str = ""
  spec: PrefillCase | DecodeCase | GmmCase | None = None
  first_s: float | None = None  # the first call: compile + run
  num_timed: int = 0
  matches_reference: bool | None = None  # ours only: within the dtype's kernel tolerance


@dataclasses.dataclass
class Report:
  ceilings: dict[str, float]
  rows: list[Row]


@dataclasses.dataclass
class Timing:
  first_s: float
  median_s: float | None
  num_timed: int
  output: object


def time_calls(fn: Callable[[], jax.Array], repeats: int, budget_s: float) -> Timing:
  """Times the first call (compile + run), then up to `repeats` calls while `budget_s` lasts.

  One timed call follows whenever the first call ended within the budget (it is
  no slower than the first, which also compiled, so a row overruns its budget
  by at most that one call); each further call only if the one before it,
  added to the time already spent, still fits.
  """
  start = time.perf_counter()
  output = jax.block_until_ready(fn())
  first = time.perf_counter() - start
  times: list[float] = []
  while len(times) < repeats:
    elapsed = time.perf_counter() - start
    if elapsed > budget_s or (times and elapsed + times[-1] > budget_s):
      break
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return Timing(first, statistics.median(times) if times else None, len(times), output)


def _short_error(err: Exception) -> str:
  text = str(err).strip().splitlines()
  return f"{type(err).__name__}: {text[0][:60] if text else ''}"


def device_memory_bytes() -> int | None:
  """What the first device reports it can allocate, or None (e.g. on CPU)."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 (not every backend implements memory_stats)
    return None
  return stats.get("bytes_limit")


def measure_ceilings(*, small: bool, repeats: int, budget_s: float = 60.0) -> dict[str, float]:
  """Copy bandwidth (GB/s, read + write) and bf16 matmul throughput (TFLOP/s)."""
  n = (1 << 20) if small else (1 << 30)  # elements; 2 GiB of bf16 on a GPU
  copy = jax.jit(lambda a: a + jnp.bfloat16(1))
  src = jnp.ones((n,), jnp.bfloat16)
  t = time_calls(lambda: copy(src), repeats, budget_s / 2)
  t_copy = t.median_s or t.first_s
  m = 256 if small else 8192
  # Random operands: all-ones matmuls draw less power and can clock higher.
  key_a, key_b = jax.random.split(jax.random.key(0))
  a = jax.random.normal(key_a, (m, m), jnp.bfloat16)
  b = jax.random.normal(key_b, (m, m), jnp.bfloat16)
  matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
  t = time_calls(lambda: matmul(a, b), repeats, budget_s / 2)
  t_mm = t.median_s or t.first_s
  return {"copy_gbps": 2 * n * 2 / t_copy / 1e9, "copy_s": t_copy,
          "matmul_tflops": 2 * m**3 / t_mm / 1e12, "matmul_s": t_mm}


def _max_temp_bytes(device_bytes: int | None) -> float:
  if device_bytes is None:
    return _MAX_TEMP_BYTES
  return min(_MAX_TEMP_BYTES, _MAX_TEMP_FRACTION * device_bytes)


def _prefill_impls(case: PrefillCase, *, interpret: bool, flash_blocks, device_bytes):
  dtype = jnp.bfloat16
  B, L, Hq, Hkv, D = (case.batch, case.seq_len, case.num_q_heads, case.num_kv_heads,
                      case.head_dim)
  # Drawn on the device: host random numbers for the large cases take longer than the kernels.
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (B, L, Hq, D), dtype)
  k = jax.random.normal(kk, (B, L, Hkv, D), dtype)
  v = jax.random.normal(kv, (B, L, Hkv, D), dtype)
  scale = 1.0 / np.sqrt(D)
  impls = {}

  packed = [x.reshape(B * L, x.shape[2], D) for x in (q, k, v)]
  cu = jnp.arange(B + 1, dtype=jnp.int32) * L
  impls[OURS_PREFILL] = lambda: flash_attention(
      *packed, cu, causal=True, sm_scale=scale, block_sizes=flash_blocks, interpret=interpret)

  logits_bytes = B * Hq * L * L * 4
  for impl, name in (("xla", XLA_PREFILL), ("cudnn", CUDNN_PREFILL)):
    if impl == "cudnn" and jax.default_backend() != "gpu":
      impls[name] = CUDNN_NA
      continue
    if impl == "xla" and logits_bytes > _max_temp_bytes(device_bytes):
      impls[name] = f"skip: {logits_bytes / 2**30:.0f} GiB of logits would not fit"
      continue
    fn = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, implementation=impl))
    impls[name] = lambda fn=fn: fn(q, k, v)

  try:  # JAX's shipped Pallas kernel, as a baseline only.
    from jax.experimental.pallas.ops.gpu import attention as jax_pallas_attention  # noqa: PLC0415
    group = Hq // Hkv
    k_rep, v_rep = (jnp.repeat(x, group, axis=2) for x in (k, v))  # it has no GQA
    mha = jax.jit(lambda q, k, v: jax_pallas_attention.mha(
        q, k, v, None, sm_scale=scale, causal=True, interpret=interpret))
    impls[MHA_PREFILL] = lambda: mha(q, k_rep, v_rep)
  except Exception as err:  # noqa: BLE001 (any import/API drift just drops the baseline)
    impls[MHA_PREFILL] = f"unavailable: {_short_error(err)}"
  return impls


def _decode_input_bytes(case: DecodeCase) -> int:
  # k and v caches plus their contiguous copies for the baselines, bf16.
  return 4 * case.num_seqs * case.context_len * case.num_kv_heads * case.head_dim * 2


def _decode_impls(case: DecodeCase, *, interpret: bool, paged_blocks, device_bytes):
  if device_bytes is not None and _decode_input_bytes(case) > _MAX_INPUT_FRACTION * device_bytes:
    note = (f"skip: {_decode_input_bytes(case) / 2**30:.1f} GiB of caches would not fit "
            f"{device_bytes / 2**30:.0f} GiB")
    return {OURS_DECODE: note, XLA_DECODE: note, CUDNN_DECODE: note}
  rng = np.random.default_rng(1)
  dtype = jnp.bfloat16
  S, C, Hq, Hkv, D, P = (case.num_seqs, case.context_len, case.num_q_heads, case.num_kv_heads,
                         case.head_dim, case.block_size)
  pages = -(-C // P)
  num_blocks = S * pages + 1
  kk, kv, kq = jax.random.split(jax.random.key(1), 3)
  k_cache = jax.random.normal(kk, (num_blocks, P, Hkv, D), dtype)
  v_cache = jax.random.normal(kv, (num_blocks, P, Hkv, D), dtype)
  tables = jnp.asarray(rng.permutation(num_blocks)[:S * pages].reshape(S, pages), jnp.int32)
  context_lens = jnp.full((S,), C, jnp.int32)
  q = jax.random.normal(kq, (S, Hq, D), dtype)
  scale = 1.0 / np.sqrt(D)
  impls = {OURS_DECODE: lambda: paged_attention(
      q, k_cache, v_cache, tables, context_lens, sm_scale=scale, block_sizes=paged_blocks,
      interpret=interpret)}

  # The same data gathered once into a contiguous [S, ctx, Hkv, D] cache.
  def gather(cache):
    return cache[tables].reshape(S, pages * P, Hkv, D)[:, :C]
  k_contig, v_contig = jax.jit(gather)(k_cache), jax.jit(gather)(v_cache)
  q4 = q[:, None]
  for impl, name in (("xla", XLA_DECODE), ("cudnn", CUDNN_DECODE)):
    if impl == "cudnn" and jax.default_backend() != "gpu":
      impls[name] = CUDNN_NA
      continue
    fn = jax.jit(lambda q, k, v, lens, impl=impl: jax.nn.dot_product_attention(
        q, k, v, scale=scale, key_value_seq_lengths=lens, implementation=impl))
    impls[name] = lambda fn=fn: fn(q4, k_contig, v_contig, context_lens)
  return impls


def _gmm_impls(case: GmmCase, *, interpret: bool, gmm_blocks, device_bytes):
  dtype = jnp.bfloat16
  weight_bytes = case.num_groups * case.k * case.n * jnp.dtype(dtype).itemsize
  if device_bytes is not None and weight_bytes > _MAX_INPUT_FRACTION * device_bytes:
    note = f"skip: {weight_bytes / 2**30:.1f} GiB of weights would not fit {device_bytes / 2**30:.0f} GiB"
    return {OURS_GMM: note, XLA_GMM: note}
  kl, kr = jax.random.split(jax.random.key(2))
  rows = case.tokens * case.top_k
  lhs = (jax.random.normal(kl, (rows, case.k), jnp.float32) / np.sqrt(case.k)).astype(dtype)  # unit outputs
  rhs = jax.random.normal(kr, (case.num_groups, case.k, case.n), dtype)
  sizes = jnp.asarray(case.group_sizes())
  ragged = jax.jit(lambda a, b, c: jax.lax.ragged_dot(a, b, c, preferred_element_type=jnp.float32
                                                      ).astype(a.dtype))
  return {OURS_GMM: lambda: grouped_matmul(lhs, rhs, sizes, block_sizes=gmm_blocks, interpret=interpret),
          XLA_GMM: lambda: ragged(lhs, rhs, sizes)}


class RowPrinter:
  """Prints a table one row at a time (flushed), with widths fixed up front."""

  def __init__(self, title: str, case_names, impl_names, rate_unit: str, fraction_of: str,
               out: Callable[[str], None]):
    self.out = out
    self.widths = [max(map(len, case_names), default=4), max(map(len, impl_names), default=4),
                   9, 9, 9, 7]
    header = ("case", "impl", "ms", rate_unit, f"of {fraction_of}", "first s")
    out(f"\n{title}")
    self._line(header, "note")
    out("  ".join("-" * w for w in self.widths) + "  ----")

  def _line(self, cells, note):
    text = "  ".join(c.ljust(w) for c, w in zip(cells, self.widths))
    self.out(f"{text}  {note}".rstrip())

  def row(self, r: Row):
    self._line((r.case, r.impl,
                "-" if r.seconds is None else f"{r.seconds * 1e3:.3f}",
                "-" if r.rate is None else f"{r.rate:.4g}",
                "-" if r.fraction is None else f"{100 * r.fraction:.1f}%",
                "-" if r.first_s is None else f"{r.first_s:.2f}"), r.note)


class _Run:
  """Shared state of one benchmark run: the deadline and each impl's last time per unit of work."""

  def __init__(self, repeats: int, case_timeout_s: float, max_seconds: float | None):
    self.repeats = repeats
    self.case_timeout_s = case_timeout_s
    self.deadline = None if max_seconds is None else time.perf_counter() + max_seconds
    self.last: dict[str, tuple[float, float, str]] = {}  # impl -> (work, seconds, case name)

  def budget(self) -> float:
    if self.deadline is None:
      return self.case_timeout_s
    return min(self.case_timeout_s, self.deadline - time.perf_counter())

  def past_deadline(self, impl_names) -> dict[str, str] | None:
    """Skip notes for every implementation once --max-seconds is spent (no inputs are made)."""
    if self.budget() > 0:
      return None
    return {name: "skip: --max-seconds reached" for name in impl_names}

  def predicted_skip(self, impl: str, work: float, budget: float) -> str | None:
    if impl not in self.last:
      return None
    prev_work, prev_s, prev_case = self.last[impl]
    predicted = prev_s * work / prev_work
    if predicted <= budget:
      return None
    return (f"skip: ~{predicted:.3g} s a call (scaled from {prev_case}) > {budget:.0f} s "
            "case budget")

  def measure(self, table, case, impls, work, to_rate, ceiling, *, ours, reference,
              emit) -> list[Row]:
    """Times every implementation on one case, emitting each row as it is measured."""
    rows, outputs = [], {}
    # The reference first, so that ours' row can carry its difference when printed.
    order = sorted(impls, key=lambda name: name != reference)
    for impl in order:
      fn = impls[impl]
      row = Row(table, case.name, impl, None, None, None, spec=case)
      budget = self.budget()
      if isinstance(fn, str):
        row.note = fn
      elif budget <= 0:
        row.note = "skip: --max-seconds reached"
      elif skip := self.predicted_skip(impl, work, budget):
        row.note = skip
      else:
        try:
          timing = time_calls(fn, self.repeats, budget)
        except Exception as err:  # noqa: BLE001 (e.g. cudnn absent: report, keep going)
          row.note = _short_error(err)
        else:
          if impl in (ours, reference):
            outputs[impl] = timing.output
          row.first_s, row.num_timed = timing.first_s, timing.num_timed
          self.last[impl] = (work, timing.median_s or timing.first_s, case.name)
          if timing.median_s is None:
            row.note = (f"first call {timing.first_s:.3g} s (compile + run) left no time "
                        f"in the {budget:.0f} s budget for a timed call")
          else:
            row.seconds = timing.median_s
            row.rate = to_rate(timing.median_s)
            row.fraction = row.rate / ceiling if ceiling else None
      if impl == ours and ours in outputs and reference in outputs:
        note, row.matches_reference = _compare(outputs[ours], outputs[reference], reference)
        row.note = (row.note + "; " if row.note else "") + note
      rows.append(row)
      emit(row)
    return rows


def _compare(ours, reference, reference_name) -> tuple[str, bool]:
  a = np.asarray(ours, np.float32)
  b = np.asarray(reference, np.float32).reshape(a.shape)
  close = bool(np.allclose(a, b, **tolerance(ours.dtype)))
  note = f"max|diff| vs {reference_name.split()[0]}: {np.max(np.abs(a - b)):.2e}"
  return note + ("" if close else " (outside tolerance)"), close


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
    for context_len in (128, 1024, 4096, 8192, 32768):
      if num_seqs * context_len <= (1 << 21):  # <= 8 GiB per bf16 cache
        cases.append(DecodeCase(num_seqs, context_len, 32, 8, 128))
  return cases


def gmm_cases(small: bool) -> list[GmmCase]:
  if small:
    return [GmmCase(8, 2, 4, 32, 32), GmmCase(5, 2, 3, 16, 48)]
  cases = []
  # Qwen3-MoE's experts (hidden 2048, intermediate 768: gate/up then down) at 64 and 128 experts,
  # and Mixtral's 8 (hidden 4096, intermediate 14336: gate/up), at a decode step and a prefill.
  for num_groups, top_k, k, n in ((64, 4, 2048, 1536), (128, 8, 2048, 1536), (128, 8, 768, 2048),
                                  (8, 2, 4096, 28672)):
    for tokens in (64, 1024):
      cases.append(GmmCase(tokens, top_k, num_groups, k, n))
  return cases


def run(*, parts=("ceilings", "prefill", "decode"), prefill: list[PrefillCase] | None = None,
        decode: list[DecodeCase] | None = None, gmm: list[GmmCase] | None = None,
        interpret: bool = False, repeats: int = 10,
        case_timeout_s: float = 30.0, max_seconds: float | None = None,
        flash_blocks: FlashBlockSizes | None = None,
        paged_blocks: PagedBlockSizes | None = None,
        gmm_blocks: GmmBlockSizes | None = None,
        out: Callable[[str], None] | None = None) -> Report:
  """Measures the ceilings and the requested tables, printing each row as it comes."""
  def emit(line: str) -> None:
    (out or print)(line)
    sys.stdout.flush()

  small = interpret
  prefill = prefill_cases(small) if prefill is None else prefill
  decode = decode_cases(small) if decode is None else decode
  gmm = gmm_cases(small) if gmm is None else gmm
  state = _Run(repeats, case_timeout_s, max_seconds)
  device_bytes = device_memory_bytes()
  emit(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"
       f", interpret={interpret}, repeats={repeats}, case budget {case_timeout_s:g} s"
       + ("" if max_seconds is None else f", at most {max_seconds:g} s in all"))
  # Always measured: the fractions in the other tables are relative to these.
  ceilings = measure_ceilings(small=small, repeats=repeats, budget_s=2 * case_timeout_s)
  emit(f"\nceilings: copy {ceilings['copy_gbps']:.1f} GB/s (read+write), "
       f"bf16 matmul {ceilings['matmul_tflops']:.1f} TFLOP/s")
  report = Report(ceilings, [])

  if "prefill" in parts and prefill:
    names = (OURS_PREFILL, XLA_PREFILL, CUDNN_PREFILL, MHA_PREFILL)
    printer = RowPrinter("prefill (causal, GQA, bf16)", [c.name for c in prefill], names,
                         "TFLOP/s", "matmul", emit)
    for case in prefill:
      impls = state.past_deadline(names) or _prefill_impls(
          case, interpret=interpret, flash_blocks=flash_blocks, device_bytes=device_bytes)
      report.rows += state.measure(
          "prefill", case, impls, case.flops, lambda s, case=case: case.flops / s / 1e12,
          ceilings["matmul_tflops"], ours=OURS_PREFILL, reference=XLA_PREFILL,
          emit=printer.row)
      del impls

  def bandwidth_table(table, title, cases, names, make_impls, ours, reference):
    """A table in GB/s of each case's bytes_moved, as a fraction of the copy ceiling."""
    printer = RowPrinter(title, [c.name for c in cases], names, "GB/s", "copy", emit)
    for case in cases:
      impls = state.past_deadline(names) or make_impls(case)
      nbytes = case.bytes_moved(jnp.dtype(jnp.bfloat16).itemsize)
      report.rows += state.measure(
          table, case, impls, nbytes, lambda s, nbytes=nbytes: nbytes / s / 1e9,
          ceilings["copy_gbps"], ours=ours, reference=reference, emit=printer.row)
      del impls

  if "decode" in parts and decode:
    bandwidth_table("decode", "decode (one query per sequence, bf16, block_size 16)", decode,
                    (OURS_DECODE, XLA_DECODE, CUDNN_DECODE),
                    lambda case: _decode_impls(case, interpret=interpret, paged_blocks=paged_blocks,
                                               device_bytes=device_bytes),
                    OURS_DECODE, XLA_DECODE)
  if "gmm" in parts and gmm:
    bandwidth_table("gmm", "grouped matmul (MoE expert products, bf16, uniform routing)", gmm,
                    (OURS_GMM, XLA_GMM),
                    lambda case: _gmm_impls(case, interpret=interpret, gmm_blocks=gmm_blocks,
                                            device_bytes=device_bytes),
                    OURS_GMM, XLA_GMM)
  return report


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m pallas_kernels.bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--interpret", action="store_true",
                      help="tiny shapes, Pallas interpreter (CPU smoke test)")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed calls per measurement (default 10, 1 with --interpret)")
  parser.add_argument("--only", choices=("ceilings", "prefill", "decode", "gmm"), action="append",
                      help="run only these parts (repeatable)")
  parser.add_argument("--case-timeout-s", type=float, default=30.0,
                      help="time budget of each row, one implementation on one case (default 30)")
  parser.add_argument("--max-seconds", type=float, default=None,
                      help="time budget of the whole run; later rows are skipped with a note")
  parser.add_argument("--block-q", type=int, default=None, help="flash_attention block_q")
  parser.add_argument("--block-kv", type=int, default=None, help="flash_attention block_kv")
  parser.add_argument("--num-splits", type=int, default=None, help="paged_attention num_splits")
  parser.add_argument("--gmm-block-m", type=int, default=None, help="grouped_matmul block_m")
  parser.add_argument("--gmm-block-n", type=int, default=None, help="grouped_matmul block_n")
  parser.add_argument("--gmm-block-k", type=int, default=None, help="grouped_matmul block_k")
  args = parser.parse_args(argv)
  flash_kwargs = {k: v for k, v in (("block_q", args.block_q), ("block_kv", args.block_kv))
                  if v is not None}
  gmm_kwargs = {k: v for k, v in (("block_m", args.gmm_block_m), ("block_n", args.gmm_block_n),
                                   ("block_k", args.gmm_block_k)) if v is not None}
  run(parts=set(args.only or ("ceilings", "prefill", "decode", "gmm")), interpret=args.interpret,
      repeats=args.repeats or (1 if args.interpret else 10), case_timeout_s=args.case_timeout_s,
      max_seconds=args.max_seconds, flash_blocks=FlashBlockSizes(**flash_kwargs),
      paged_blocks=PagedBlockSizes(num_splits=args.num_splits), gmm_blocks=GmmBlockSizes(**gmm_kwargs))
  return 0


if __name__ == "__main__":
  sys.exit(main())
