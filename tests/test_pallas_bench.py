"""`python -m pallas_kernels.bench`: the --interpret smoke run (tiny shapes on CPU) and its bounds."""

import re
import time

import jax.numpy as jnp
import pytest

from pallas_kernels import bench


@pytest.mark.slow
def test_bench_interpret_smoke(capsys):
  assert bench.main(["--interpret", "--repeats", "1"]) == 0
  out = capsys.readouterr().out
  assert "ceilings: copy" in out
  assert "prefill (causal, GQA, bf16)" in out
  assert "decode (one query per sequence" in out
  assert "grouped matmul (MoE expert products" in out
  ours = [line for line in out.splitlines() if "ours (" in line]
  assert len(ours) == len(bench.prefill_cases(True)) + len(bench.decode_cases(True)) + len(bench.gmm_cases(True))
  for line in ours:
    # Every row of ours has a time and agrees with XLA to bf16 accuracy.
    diff = float(re.search(r"max\|diff\| vs \S+: (\S+)", line).group(1))
    assert diff < 5e-2, line
  # cuDNN has no rows to time on a CPU: they say so rather than print JAX's "cuDNN is not detected".
  cudnn = [line for line in out.splitlines() if "[cudnn]" in line]
  assert cudnn and all(bench.CUDNN_NA in line for line in cudnn), cudnn
  assert "not detected" not in out


def test_bench_full_case_lists_are_sane():
  prefill = bench.prefill_cases(False)
  decode = bench.decode_cases(False)
  assert {c.head_dim for c in prefill} == {64, 128}
  assert {c.batch for c in prefill} == {1, 4, 16}
  assert {c.seq_len for c in prefill} == {512, 2048, 8192}
  assert {c.num_seqs for c in decode} == {1, 16, 64, 256}
  assert {c.context_len for c in decode} == {128, 1024, 4096, 8192, 32768}
  # The decode target (64 sequences x 4k context) is one of the cases.
  assert any(c.num_seqs == 64 and c.context_len == 4096 for c in decode)
  # The MoE layer shape of issue 51's target (64 experts, top-4, 64 tokens) is a grouped-matmul case,
  # and its routing gives every token top_k distinct experts.
  gmm = bench.gmm_cases(False)
  target = next(c for c in gmm if (c.tokens, c.top_k, c.num_groups) == (64, 4, 64))
  assert target.group_sizes().sum() == 64 * 4 and target.group_sizes().max() <= 64


def _sleeper(seconds):
  def fn():
    time.sleep(seconds)
    return jnp.zeros(())
  return fn


def test_time_calls_stops_when_the_budget_is_spent():
  timing = bench.time_calls(_sleeper(0.05), repeats=100, budget_s=0.3)
  assert timing.first_s >= 0.05
  assert 1 <= timing.num_timed < 6
  # A first call longer than the budget leaves no timed call at all.
  timing = bench.time_calls(_sleeper(0.05), repeats=100, budget_s=0.04)
  assert timing.num_timed == 0 and timing.median_s is None


def _measure(state, case, impls, work):
  rows = []
  state.measure("t", case, impls, work, lambda s: work / s, 1.0, ours="ours", reference="ref",
                emit=rows.append)
  return rows


def test_slow_baseline_is_skipped_from_its_previous_time():
  state = bench._Run(repeats=2, case_timeout_s=1.0, max_seconds=None)
  small, large = bench.PrefillCase(1, 64, 4, 2, 64), bench.PrefillCase(1, 4096, 4, 2, 64)
  impls = {"ref": _sleeper(0.02), "ours": _sleeper(0.001), "note only": "skip: reason"}
  rows = {r.impl: r for r in _measure(state, small, impls, small.flops)}
  assert rows["ref"].seconds and rows["ours"].seconds and rows["ours"].num_timed == 2
  assert rows["ours"].note.startswith("max|diff| vs ref: 0.00e+00")
  assert rows["note only"].note == "skip: reason"
  # 4096x the flops: ref predicts ~80 s a call, ours ~4 s; both over the 1 s budget.
  start = time.perf_counter()
  rows = {r.impl: r for r in _measure(state, large, impls, large.flops)}
  assert time.perf_counter() - start < 0.5
  for impl in ("ref", "ours"):
    assert rows[impl].seconds is None
    assert "skip: ~" in rows[impl].note and "scaled from B=1 L=64" in rows[impl].note


def test_max_seconds_skips_the_rest():
  state = bench._Run(repeats=1, case_timeout_s=10.0, max_seconds=0.05)
  case = bench.DecodeCase(1, 16, 4, 2, 64)
  rows = _measure(state, case, {"ref": _sleeper(0.06), "ours": _sleeper(0.0)}, 1.0)
  assert rows[0].impl == "ref" and rows[0].first_s >= 0.06
  assert rows[1].note == "skip: --max-seconds reached"


def test_ours_outside_tolerance_is_flagged():
  state = bench._Run(repeats=1, case_timeout_s=5.0, max_seconds=None)
  case = bench.DecodeCase(1, 16, 4, 2, 64)
  ref = lambda: jnp.zeros((4,), jnp.bfloat16)  # noqa: E731
  rows = _measure(state, case, {"ours": lambda: jnp.full((4,), 0.1, jnp.bfloat16), "ref": ref}, 1.0)
  (ours,) = [r for r in rows if r.impl == "ours"]
  assert ours.matches_reference is False and "(outside tolerance)" in ours.note
  rows = _measure(state, case, {"ours": lambda: jnp.full((4,), 0.01, jnp.bfloat16), "ref": ref}, 1.0)
  assert [r.matches_reference for r in rows if r.impl == "ours"] == [True]


def test_run_past_max_seconds_lists_every_row_as_skipped(capsys):
  report = bench.run(parts=("prefill", "decode"), interpret=True, repeats=1, max_seconds=0.0)
  assert len(report.rows) == 4 * len(bench.prefill_cases(True)) + 3 * len(bench.decode_cases(True))
  assert {r.note for r in report.rows} == {"skip: --max-seconds reached"}
  assert capsys.readouterr().out.count("skip: --max-seconds reached") == len(report.rows)
