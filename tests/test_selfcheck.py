"""`python -m runtime.selfcheck`: --quick passes on this CPU, and each kind of failure shows."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from conftest import ROOT
from pallas_kernels import bench
from runtime.tools import selfcheck, selfcheck_parts


@pytest.mark.slow  # five subprocesses, about a minute; CI runs it
def test_quick_run_passes_with_a_table_and_json(tmp_path):
  out = tmp_path / "selfcheck.json"
  t0 = time.monotonic()
  proc = subprocess.run([sys.executable, "-m", "runtime.tools.selfcheck", "--quick", "--json", str(out)],
                        cwd=ROOT, capture_output=True, text=True, timeout=360)
  elapsed = time.monotonic() - t0
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  assert elapsed < 300
  report = json.loads(out.read_text())
  parts = {p["part"]: p for p in report["parts"]}
  assert list(parts) == list(selfcheck.PARTS)
  assert {p["status"] for p in parts.values()} == {"PASS"}
  # The table: one line per part, then the targets, then the verdict.
  table = proc.stdout[proc.stdout.index("\nselfcheck --quick"):]
  for name in selfcheck.PARTS:
    assert f"\n{name} " in table
  assert "PASS: 6/6 parts passed" in table
  cpu = parts["cpu"]["data"]  # the C++ kernels and the GGUF block and tile paths, on this CPU's paths
  names = [r["check"] for r in cpu["rows"]]
  assert all(r["ok"] for r in cpu["rows"]) and len(names) == 14
  assert any("blocks" in n for n in names) and any("tiles, f32" in n for n in names)

  kernels = parts["kernels"]["data"]["rows"]
  assert {r["dtype"] for r in kernels} == {"float32", "bfloat16"}
  assert {r["case"].split()[0] for r in kernels} == {"flash_attention", "paged_attention", "grouped_matmul"}
  assert all(r["ok"] and r["max_abs_diff"] < 2e-2 for r in kernels)
  tiny = parts["tiny"]["data"]
  assert tiny["pallas_backend"] == "interpret"
  # Every sequence equal, or split only where two tokens tie to within rounding.
  for r in tiny["dtypes"].values():
    assert r["ok"] and r["equal"] + r["near_ties"] == 5
  thr = parts["throughput"]["data"]  # on a CPU: what a CPU engine runs, our C++ kernels against XLA
  assert not thr["full_shape"] and "(--quick)" in thr["shape"]
  assert thr["against_xla"] == "cpp" and set(thr["results"]) == {"xla", "cpp"}
  assert "pallas/xla n.a. (needs a GPU)" in parts["throughput"]["summary"]
  for r in thr["results"].values():
    assert r["batch1"] > 0 and r["batch64"] > 0 and r["recompiles"] == 0
    assert r["async"] is False and r["batch1_async_flipped"] > 0  # auto: off on CPU; the flipped run matched
  rows = parts["bench"]["data"]["rows"]
  ours = [r for r in rows if r["impl"].startswith("ours")]
  assert len(ours) == len(bench.prefill_cases(True)) + len(bench.decode_cases(True))
  # Each table's first case is timed; a later one may meet the part's time budget on a loaded machine
  # (CI's did once), and then says so in its note rather than fail.
  for table in {r["table"] for r in ours}:
    first = next(r for r in ours if r["table"] == table)
    assert first["seconds"] > 0, first
  assert all(r["seconds"] or r["note"].startswith("skip: ") for r in ours), ours
  # Nothing here can measure the H200 targets; they say so rather than pass.
  assert [t["status"] for t in report["targets"]] == ["n.a."] * 4


def test_cpu_part_checks_the_kernels_against_their_references(monkeypatch):
  """A block product that is off by a little fails its rows, and only those; every other check
  of the part runs and passes (the GGUF ones here: they are the fast ones)."""
  from runtime.tools import selfcheck_cpu
  from runtime.worker import cpp_kernels

  if not cpp_kernels.available():
    pytest.skip("the C++ kernels do not build here")
  checks = [c for c in selfcheck_cpu.cpu_checks(selfcheck_cpu.cpu_features()) if c[0].startswith("GGUF q4_1")]
  assert len(checks) == 3  # blocks, tiles with f32 activations, tiles with q8 ones
  assert all(selfcheck_cpu._miss(*run(), attention=False)[0] for _, run, _ in checks)
  real = cpp_kernels.block_matmul
  monkeypatch.setattr(cpp_kernels, "block_matmul", lambda *a, **k: real(*a, **k) * 1.001)
  verdicts = {name: selfcheck_cpu._miss(*run(), attention=False)[0] for name, run, _ in checks}
  assert [n for n, ok in verdicts.items() if not ok] == [checks[0][0]]  # the blocks' row


def test_cpu_part_is_na_off_the_cpu(monkeypatch, tmp_path):
  import jax

  from runtime.tools import selfcheck_cpu

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  ok, summary, data = selfcheck_cpu.part_cpu(SimpleNamespace())
  assert ok and summary.startswith("n.a.") and data == {"applies": False}
  monkeypatch.setitem(selfcheck.PART_FUNCTIONS, "cpu", selfcheck_cpu.part_cpu)
  assert selfcheck.run_child(SimpleNamespace(part="cpu", result=str(tmp_path / "r.json"))) == 0
  assert json.loads((tmp_path / "r.json").read_text())["status"] == "n.a."


def test_throughput_on_a_cpu_times_what_the_cpu_runs(monkeypatch, tmp_path):
  """On a CPU the throughput part times our C++ kernels against XLA (Pallas's interpreter times
  nothing a CPU runs); without the C++ kernels it is n.a., never a ratio of the interpreter."""
  from runtime.worker import cpp_kernels

  monkeypatch.setattr(selfcheck_parts, "_on_gpu", lambda: False)
  monkeypatch.setattr(cpp_kernels, "available", lambda: True)
  assert selfcheck_parts.throughput_rival(False)[0] == "cpp"
  assert selfcheck_parts.throughput_rival(True)[0] == "pallas"
  monkeypatch.setattr(cpp_kernels, "available", lambda: False)
  assert selfcheck_parts.throughput_rival(False)[0] is None
  monkeypatch.setitem(selfcheck.PART_FUNCTIONS, "throughput", selfcheck_parts.part_throughput)
  assert selfcheck.run_child(SimpleNamespace(part="throughput", quick=True, result=str(tmp_path / "r.json"))) == 0
  result = json.loads((tmp_path / "r.json").read_text())
  assert result["status"] == "n.a." and "needs a GPU" in result["summary"]


def test_a_hang_is_a_timeout_and_the_exit_status_is_1(tmp_path, capsys):
  out = tmp_path / "r.json"
  # 20 s x 0.001: the child cannot even import jax in time.
  assert selfcheck.main(["--only", "devices", "--timeout-scale", "0.001", "--json", str(out)]) == 1
  (part,) = json.loads(out.read_text())["parts"]
  assert part["status"] == "TIMEOUT" and part["seconds"] < 10
  assert "devices TIMEOUT; last lines of its output" in capsys.readouterr().out


def test_a_failing_part_shows_its_output_tail(capsys):
  assert selfcheck.main(["--only", "devices", "--expect-backend", "gpu"]) == 1
  out = capsys.readouterr().out
  table = out[out.index("\nselfcheck"):]
  assert "devices  FAIL" in table and "backend is cpu, expected gpu" in table
  # The tail repeats what the child printed, e.g. its device table.
  assert "devices FAIL; last lines of its output" in table and "128x128 f32 matmul" in table
  assert "FAIL: 0/1 parts passed" in table


def _wrong_flash(kind):
  from pallas_kernels import flash_attention_reference

  def kernel(q, k, v, cu, *, interpret):
    out = flash_attention_reference(q, k, v, cu)
    if kind == "offset":
      return out + 0.1
    if kind == "padding":
      return out.at[-1].set(1.0)
    return out.at[0, 0, 0].set(jnp.nan)
  return kernel


@pytest.mark.parametrize("kind,problem", [("offset", "outside tolerance"),
                                          ("padding", "padding rows are not zero"),
                                          ("nan", "non-finite output")])
def test_kernel_part_catches_a_wrong_kernel(monkeypatch, kind, problem):
  import pallas_kernels

  monkeypatch.setattr(selfcheck_parts, "kernel_cases",
                      lambda large: [selfcheck_parts._flash_case([5, 20], 3, 4, 2, 64)])
  monkeypatch.setattr(pallas_kernels, "flash_attention", _wrong_flash(kind))
  ok, summary, data = selfcheck_parts.part_kernels(SimpleNamespace(quick=True))
  assert not ok and "0/2 within tolerance" in summary
  assert all(problem in r["problem"] for r in data["rows"])


def test_kernel_part_catches_a_wrong_grouped_matmul(monkeypatch):
  import pallas_kernels

  def wrong_groups(lhs, rhs, sizes, *, interpret):  # every row through the first group's matrix
    return pallas_kernels.grouped_matmul_reference(lhs, rhs, sizes.at[0].set(lhs.shape[0]))

  monkeypatch.setattr(selfcheck_parts, "kernel_cases",
                      lambda large: [selfcheck_parts._gmm_case([3, 0, 9], 2, 32, 16)])
  monkeypatch.setattr(pallas_kernels, "grouped_matmul", wrong_groups)
  ok, summary, data = selfcheck_parts.part_kernels(SimpleNamespace(quick=True))
  assert not ok and "0/2 within tolerance" in summary
  assert all("outside tolerance" in r["problem"] for r in data["rows"])


def _fake_llm(split_gap):
  """xla and the other backend agree, except prompt 2 splits at token 7 with this logprob gap."""
  class FakeLLM:
    def __init__(self, backend):
      self.backend = backend

    def generate(self, prompts, params):
      outs = []
      for i, _ in enumerate(prompts):
        ids = list(range(params.max_tokens))
        lps = [{t: -0.5, t + 100: -0.5 - split_gap} for t in ids]
        if self.backend != "xla" and i == 2:
          ids[7] += 100
          lps[7] = {ids[7]: -0.5, 7: -0.5 - split_gap}
        outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=lps)]))
      return outs
  return lambda cfg, w, *, backend, **kw: FakeLLM(backend)


def test_tiny_part_fails_on_a_real_divergence(monkeypatch):
  monkeypatch.setattr(selfcheck_parts, "build_llm", _fake_llm(split_gap=0.5))
  ok, summary, data = selfcheck_parts.part_tiny(SimpleNamespace(quick=True))
  assert not ok
  assert data["dtypes"]["f32"]["equal"] == 4 and not data["dtypes"]["f32"]["ok"]
  assert data["dtypes"]["f32"]["first_split"] == "prompt 2 token 7: 7 vs 107, logprob gap 5.0e-01"
  assert "f32 4/5 equal" in summary


def test_tiny_part_allows_a_split_at_a_near_tie(monkeypatch):
  # 0.05: a tie at bf16's precision, not at f32's.
  monkeypatch.setattr(selfcheck_parts, "build_llm", _fake_llm(split_gap=0.05))
  ok, summary, data = selfcheck_parts.part_tiny(SimpleNamespace(quick=True))
  assert not ok
  assert not data["dtypes"]["f32"]["ok"]
  assert data["dtypes"]["bf16"] | {"first_split": None} == {
      "ok": True, "equal": 4, "near_ties": 1, "num_prompts": 5, "first_split": None}
  assert "bf16 4/5 equal, 1 split at a near tie" in summary


def test_compare_greedy_needs_each_token_in_the_other_top_logprobs():
  a = SimpleNamespace(token_ids=[1, 2], logprobs=[{1: -0.1}, {2: -0.1, 3: -0.1}])
  b = SimpleNamespace(token_ids=[1, 3], logprobs=[{1: -0.1}, {3: -0.1}])  # 2 not in b's top
  assert selfcheck_parts.compare_greedy(a, a, 1.0) == ("equal", "-")
  assert selfcheck_parts.compare_greedy(a, b, 1.0)[0] == "differ"
  short = SimpleNamespace(token_ids=[1], logprobs=[{1: -0.1}])
  assert selfcheck_parts.compare_greedy(a, short, 1.0) == ("differ", "token 1 (lengths differ)")


def _bench_row(impl, spec, rate=None, fraction=None, note=""):
  return {"table": "prefill" if isinstance(spec, bench.PrefillCase) else "decode", "impl": impl,
          "spec": dataclasses.asdict(spec), "rate": rate, "fraction": fraction, "note": note,
          "seconds": None if rate is None else 1.0}


def _gpu_results(ratio=1.1, rows=None):
  long, short = bench.PrefillCase(1, 2048, 32, 8, 128), bench.PrefillCase(4, 512, 32, 8, 128)
  decode = bench.DecodeCase(64, 4096, 32, 8, 128)
  if rows is None:
    rows = [_bench_row(bench.OURS_PREFILL, long, rate=300.0),
            _bench_row(bench.CUDNN_PREFILL, long, rate=500.0),  # 0.6x < 0.8x
            _bench_row(bench.OURS_PREFILL, short, rate=200.0),
            _bench_row(bench.CUDNN_PREFILL, short, rate=300.0),  # 0.67x >= 0.5x
            _bench_row(bench.OURS_DECODE, decode, rate=3500.0, fraction=0.75)]
  data = {"backend": "gpu"}
  return {
      "throughput": selfcheck.PartResult("throughput", "PASS", 1.0, "", dict(
          data, ratio_batch=ratio, full_shape=True, shape="SmolLM2-135M")),
      "bench": selfcheck.PartResult("bench", "PASS", 1.0, "", dict(data, rows=rows)),
  }


def test_targets_are_judged_from_the_numbers_on_a_gpu():
  targets = selfcheck.evaluate_targets(_gpu_results())
  assert [(s, d) for s, _, d in targets] == [
      ("PASS", "measured 1.10x"),
      ("FAIL", "worst 0.60x of cuDNN (B=1 L=2048 H=32/8 D=128) over 1 case(s)"),
      ("PASS", "worst 0.67x of cuDNN (B=4 L=512 H=32/8 D=128) over 1 case(s)"),
      ("PASS", "measured 75%")]
  assert selfcheck.evaluate_targets(_gpu_results(ratio=0.99))[0][0] == "FAIL"
  # --quick measures smaller shapes, so it judges nothing.
  assert {s for s, _, _ in selfcheck.evaluate_targets(_gpu_results(), quick=True)} == {"n.a."}


def test_targets_not_measured_on_a_gpu_fail_and_on_a_cpu_are_na():
  long = bench.PrefillCase(1, 2048, 32, 8, 128)
  rows = [_bench_row(bench.OURS_PREFILL, long, rate=300.0),
          _bench_row(bench.CUDNN_PREFILL, long, note="RuntimeError: cuDNN is not detected.")]
  results = _gpu_results(rows=rows)
  del results["throughput"]
  targets = selfcheck.evaluate_targets(results)
  assert [s for s, _, _ in targets] == ["FAIL"] * 4
  assert targets[0][2] == "not measured: the throughput part did not finish"
  assert "cuDNN is not detected" in targets[1][2]
  assert targets[2][2] == "not measured: no such case ran"
  for part in results.values():
    part.data["backend"] = "cpu"
  assert {s for s, _, _ in selfcheck.evaluate_targets(results)} == {"n.a."}
