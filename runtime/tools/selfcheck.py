"""Checks this machine and this build: `python -m runtime.selfcheck [--quick] [--json PATH]`.

Runs six parts, each in its own subprocess with its own timeout, so a hang or a crash is
reported (TIMEOUT / FAIL with the tail of its output) and the next part still runs:

  devices     versions, devices, and one matmul checked against numpy
  cpu         what a CPU engine runs: our C++ kernels (paged attention, f32 and int8 rows, GGUF
              blocks and tiles) against their references, on the vector paths this CPU has
              (runtime/tools/selfcheck_cpu.py); n.a. off the CPU backend
  kernels     every Pallas kernel (attention, the grouped matmul of MoE layers) against its jnp
              reference at f32 and bf16 (compiled on a GPU, interpreted elsewhere)
  tiny        the tiny model through the Pallas kernels against XLA, greedy, token for token
              (a split passes only at a near tie: see compare_greedy)
  throughput  SmolLM2-135M's shape with random weights, at one sequence and at 64, over a small
              bucket table: Pallas against XLA on a GPU; on a CPU our C++ kernels against XLA
              (what a CPU engine runs; pallas/xla is n.a. there, and the part too where the
              C++ kernels do not build)
  bench       pallas_kernels.bench on the cases the targets name, each row time-capped

Then it prints one table and the performance targets (PASS / FAIL / n.a.; they are set for an
H200 and only measured by a full run on a GPU). It exits 1 if any part did not pass; target
misses count only with --strict-targets. `--quick` shrinks every part (CPU CI); its table says
where the shapes differ from the full run. On a CPU the full run's throughput part (SmolLM2's 30
layers, twice) may not finish within its timeout: use --quick there.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from runtime.entrypoints.args import ArgumentParser
from runtime.tools.selfcheck_cpu import part_cpu
from runtime.tools.selfcheck_parts import (_print_rows, part_bench, part_devices, part_kernels, part_throughput,
                                     part_tiny)

PARTS = ("devices", "cpu", "kernels", "tiny", "throughput", "bench")
# Seconds each part may take: (full run on a GPU, --quick). Even if every part hangs, the full
# run ends within 11 minutes and --quick within 8 (over 2x what each --quick part took with a cold
# compilation cache on a 2-core CPU under a load average of 5; the cpu part's includes building the
# C++ kernels with an empty kernel cache, about 50 s there). The kernels part took 40 s --quick
# under a load average of 8 with the grouped matmul's rows (4 s of it).
TIMEOUTS = {"devices": (30, 20), "cpu": (150, 150), "kernels": (75, 60), "tiny": (75, 90), "throughput": (180, 85),
            "bench": (120, 60)}
TAIL_LINES = 25
PASSING = ("PASS", "n.a.")  # n.a.: the part checks nothing this machine runs (the cpu part on a GPU,
# the throughput part on a CPU without the C++ kernels)
ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class PartResult:
    part: str
    status: str  # PASS, FAIL, TIMEOUT or n.a.
    seconds: float
    summary: str
    data: dict = dataclasses.field(default_factory=dict)
    tail: str = ""


def evaluate_targets(results: dict[str, PartResult], quick: bool = False) -> list[tuple[str, str, str]]:
    """(status, target, detail) for the H200 targets; n.a. where not measurable here."""
    backend = next((r.data["backend"] for r in results.values() if "backend" in r.data), None)
    targets = []

    def add(name, measure):
        if backend != "gpu":
            targets.append(("n.a.", name, f"needs a GPU (backend here: {backend or 'unknown'})"))
            return
        if quick:
            targets.append(("n.a.", name, "--quick runs smaller shapes; the full run measures it"))
            return
        try:
            status, detail = measure()
        except LookupError as err:
            status, detail = "FAIL", f"not measured: {err}"
        targets.append((status, name, detail))

    def e2e():
        part = results.get("throughput")
        if part is None or "ratio_batch" not in part.data:
            raise LookupError("the throughput part did not finish")
        if not part.data["full_shape"]:
            raise LookupError(f"ran on {part.data['shape']}, not SmolLM2's shape")
        ratio = part.data["ratio_batch"]
        return ("PASS" if ratio >= 1.0 else "FAIL"), f"measured {ratio:.2f}x"

    def bench_rows():
        part = results.get("bench")
        if part is None or "rows" not in part.data:
            raise LookupError("the bench part did not finish")
        return part.data["rows"]

    def prefill(select, goal):
        def measure():
            from pallas_kernels import bench

            rows = bench_rows()
            ratios = []
            for r in rows:
                if r["table"] != "prefill" or r["impl"] != bench.OURS_PREFILL or not select(r["spec"]):
                    continue
                cudnn = next((c for c in rows if c["impl"] == bench.CUDNN_PREFILL
                              and c["spec"] == r["spec"]), None)
                if r["rate"] is None or cudnn is None or cudnn["rate"] is None:
                    why = r["note"] if r["rate"] is None else (cudnn or {}).get("note", "no cudnn row")
                    raise LookupError(f"B={r['spec']['batch']} L={r['spec']['seq_len']}: {why}")
                ratios.append((r["rate"] / cudnn["rate"], r["spec"]))
            if not ratios:
                raise LookupError("no such case ran")
            worst, spec = min(ratios, key=lambda x: x[0])
            detail = (f"worst {worst:.2f}x of cuDNN (B={spec['batch']} L={spec['seq_len']} "
                      f"H={spec['num_q_heads']}/{spec['num_kv_heads']} D={spec['head_dim']}) over "
                      f"{len(ratios)} case(s)")
            return ("PASS" if worst >= goal else "FAIL"), detail
        return measure

    def decode():
        from pallas_kernels import bench

        row = next((r for r in bench_rows() if r["impl"] == bench.OURS_DECODE
                    and r["spec"]["num_seqs"] == 64 and r["spec"]["context_len"] == 4096), None)
        if row is None or row["fraction"] is None:
            raise LookupError(row["note"] if row else "no 64 x 4096 decode case ran")
        return ("PASS" if row["fraction"] >= 0.70 else "FAIL"), f"measured {100 * row['fraction']:.0f}%"

    add("end to end: pallas >= 1.0x xla at 64 sequences (SmolLM2, bf16)", e2e)
    add("prefill flash_attention >= 0.8x cuDNN at L >= 2048",
        prefill(lambda s: s["seq_len"] >= 2048, 0.8))
    add("prefill flash_attention >= 0.5x cuDNN at L = 512", prefill(lambda s: s["seq_len"] == 512, 0.5))
    add("decode paged_attention >= 70% of copy bandwidth at 64 seqs x 4k context", decode)
    return targets


# ----------------------------------------------------------------------------- driver

PART_FUNCTIONS = {"devices": part_devices, "cpu": part_cpu, "kernels": part_kernels, "tiny": part_tiny,
                  "throughput": part_throughput, "bench": part_bench}


def run_child(args) -> int:
    """`--part NAME --result PATH`: runs one part here and writes its result as JSON."""
    t0 = time.perf_counter()
    ok, summary, data = PART_FUNCTIONS[args.part](args)
    import jax

    data["backend"] = jax.default_backend()  # the targets need it even when devices did not run
    status = "PASS" if ok else "FAIL"
    if data.get("applies") is False:  # nothing of it runs on this machine (the cpu part on a GPU)
        status = "n.a."
    Path(args.result).write_text(json.dumps(
        {"status": status, "summary": summary, "data": data,
         "seconds": time.perf_counter() - t0}, default=float))
    sys.stdout.flush()
    return 0 if ok else 1


def run_part(part: str, args, timeout_s: float) -> PartResult:
    """Runs one part in a subprocess, echoing its output; a timeout kills its process group."""
    with tempfile.TemporaryDirectory(prefix="selfcheck-") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-u", "-m", "runtime.tools.selfcheck", "--part", part,
               "--result", str(result_path)]
        if args.quick:
            cmd.append("--quick")
        if args.expect_backend:
            cmd += ["--expect-backend", args.expect_backend]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

        def pump():
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                print(f"  [{part}] {line}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            timed_out = True
        reader.join(timeout=10)
        seconds = time.perf_counter() - t0
        tail_text = "\n".join(tail)
        if timed_out:
            return PartResult(part, "TIMEOUT", seconds, f"no result within {timeout_s:.0f} s",
                              tail=tail_text)
        if not result_path.exists():
            return PartResult(part, "FAIL", seconds, f"exited with status {rc} and no result",
                              tail=tail_text)
        result = json.loads(result_path.read_text())
        return PartResult(part, result["status"], seconds, result["summary"], result["data"],
                          tail=tail_text if result["status"] not in PASSING else "")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m runtime.selfcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small shapes and short timeouts (CPU CI: well under 5 minutes)")
    parser.add_argument("--only", action="append", choices=PARTS, help="run only these parts")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--timeout-scale", type=float, default=1.0,
                        help="multiply every part's timeout (a slow or busy machine)")
    parser.add_argument("--expect-backend", choices=("cpu", "gpu", "tpu"),
                        help="fail the devices part unless JAX runs on this backend")
    parser.add_argument("--strict-targets", action="store_true",
                        help="a missed performance target also makes the exit status 1")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        return run_child(args)

    parts = [p for p in PARTS if not args.only or p in args.only]
    t_start = time.perf_counter()
    results: dict[str, PartResult] = {}
    for part in parts:
        timeout_s = TIMEOUTS[part][args.quick] * args.timeout_scale
        print(f"== {part} (timeout {timeout_s:.0f} s)", flush=True)
        results[part] = run_part(part, args, timeout_s)
        print(f"== {part}: {results[part].status} in {results[part].seconds:.1f} s", flush=True)
    total_s = time.perf_counter() - t_start

    targets = evaluate_targets(results, args.quick)
    failed = [r for r in results.values() if r.status not in PASSING]
    missed = [t for t in targets if t[0] == "FAIL"]
    exit_code = 1 if failed or (args.strict_targets and missed) else 0

    print(f"\nselfcheck{' --quick' if args.quick else ''}")
    _print_rows([("part", "status", "seconds", "result")]
                + [(r.part, r.status, f"{r.seconds:.1f}", r.summary) for r in results.values()])
    for r in failed:
        print(f"\n{r.part} {r.status}; last lines of its output:")
        print("\n".join(f"    {line}" for line in r.tail.splitlines()) or "    (none)")
    print("\ntargets (set for an H200; they change the exit status only with --strict-targets):")
    for status, name, detail in targets:
        print(f"  {status:<5} {name}: {detail}")
    print(f"\n{'PASS' if not failed else 'FAIL'}: {len(results) - len(failed)}/{len(results)} parts "
          f"passed in {total_s:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "quick": args.quick, "seconds": total_s, "exit_code": exit_code,
            "parts": [dataclasses.asdict(r) for r in results.values()],
            "targets": [dict(status=s, target=n, detail=d) for s, n, d in targets]},
            indent=2, default=float))
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
