"""Smoke test of `python -m pallas_kernels.bench --interpret` (tiny shapes on CPU)."""

import re

from pallas_kernels import bench


def test_bench_interpret_smoke(capsys):
  assert bench.main(["--interpret", "--repeats", "1"]) == 0
  out = capsys.readouterr().out
  assert "ceilings: copy" in out
  assert "prefill (causal, GQA, bf16)" in out
  assert "decode (one query per sequence" in out
  ours = [line for line in out.splitlines() if "ours (" in line]
  assert len(ours) == len(bench.prefill_cases(True)) + len(bench.decode_cases(True))
  for line in ours:
    # Every row of ours has a time and agrees with XLA to bf16 accuracy.
    diff = float(re.search(r"max\|diff\| vs \S+: (\S+)", line).group(1))
    assert diff < 5e-2, line


def test_bench_full_case_lists_are_sane():
  prefill = bench.prefill_cases(False)
  decode = bench.decode_cases(False)
  assert {c.head_dim for c in prefill} == {64, 128}
  assert {c.batch for c in prefill} == {1, 4, 16}
  assert {c.seq_len for c in prefill} == {512, 2048, 8192}
  assert {c.num_seqs for c in decode} == {1, 16, 64, 256}
  assert {c.context_len for c in decode} == {128, 1024, 8192, 32768}
