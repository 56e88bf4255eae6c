"""Times the step's sampler (runtime.worker.sampler.sample_rows) alone at 64 rows x SmolLM2's
49,152 vocabulary, against another version of sampler.py in the same process, and checks that the
two give the same tokens (and logprobs, in the case that reports them).

    git show <commit>:runtime/worker/sampler.py > /tmp/sampler_old.py
    .venv/bin/python benchmarks/bench_sampler.py --baseline /tmp/sampler_old.py [--case greedy] [--golden DIR]

Cases: greedy, "temperature 0.8", "top-p 0.9 at 0.8", "greedy + presence penalty", "greedy + logprobs".
Prints the medians of 5 rounds of 20 calls each, and the load average.

The sampler compiles into every bucket's step executable, so its compile time is paid per bucket
at a cold start. `--compile N` times that instead: a SmolLM2 ModelRunner (scan_layers, no
compilation cache) compiles its first N buckets' steps cold with each sampler, alternating, for
`--rounds` rounds, and prints each round and the best of each.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from runtime.core.sampling_params import SamplingParams  # noqa: E402
from runtime.worker import sampler  # noqa: E402

CASES = {"greedy": SamplingParams(temperature=0), "temperature 0.8": SamplingParams(temperature=0.8),
         "top-p 0.9 at 0.8": SamplingParams(temperature=0.8, top_p=0.9),
         "greedy + presence penalty": SamplingParams(temperature=0, presence_penalty=0.5),
         "greedy + logprobs": SamplingParams(temperature=0, logprobs=0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="another sampler.py")
    ap.add_argument("--case", choices=list(CASES), default="greedy")
    ap.add_argument("--golden", type=Path, default=None, metavar="DIR",
                    help="rows of real SmolLM2 logits: each DIR/*.npz's last_logits (tests/data/golden), "
                         "repeated to 64 rows; default: standard normal logits (a flat distribution)")
    ap.add_argument("--compile", type=int, default=0, metavar="N",
                    help="time the cold compile of the engine's first N buckets instead")
    ap.add_argument("--rounds", type=int, default=2, help="rounds for --compile")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("sampler_baseline", args.baseline)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old
    spec.loader.exec_module(old)
    if args.compile:
        return compile_buckets(old, args.compile, args.rounds)
    n, v = 64, 49152
    if args.golden is None:
        logits = jnp.asarray(np.random.default_rng(0).standard_normal((n, v)).astype(np.float32))
    else:
        real = [np.load(f)["last_logits"] for f in sorted(args.golden.glob("*.npz"))]
        logits = jnp.asarray(np.stack([real[i % len(real)] for i in range(n)]).astype(np.float32))
    rows = [(CASES[args.case], 0, 0, [5, 6, 7], 2)] * n
    arrays = sampler.build_inputs(rows, n, 1024, lambda p: [2], vocab_size=v).arrays()
    fns = {"baseline": jax.jit(old.sample_rows), "this checkout": jax.jit(sampler.sample_rows)}
    outs = {k: f(logits, arrays) for k, f in fns.items()}
    # The tokens; the logprobs too where the rows report them (without, this checkout returns zeros).
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in list(zip(*outs.values()))[:1 if CASES[args.case].logprobs is None else None])
    times = {k: [] for k in fns}
    for _ in range(5):
        for k, f in fns.items():
            ts = []
            for _ in range(20):
                t0 = time.perf_counter()
                jax.block_until_ready(f(logits, arrays))
                ts.append(time.perf_counter() - t0)
            times[k].append(float(np.median(ts)))
    med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    print(f"{args.case}: baseline {med['baseline']:.2f} ms, this checkout {med['this checkout']:.2f} ms, "
          f"{med['baseline'] / med['this checkout']:.2f}x, same outputs: {same}, load {os.getloadavg()[0]:.2f}")
    return 0


def compile_buckets(old, n: int, rounds: int) -> int:
    from models.weights import load_model
    from config.engine_config import EngineConfig
    from runtime.engine.plan import compile_plan
    from runtime.worker.model_runner import ModelRunner

    jax.config.update("jax_enable_compilation_cache", False)
    config, weights, tok = load_model("smollm2-135m")
    plan = compile_plan(None, EngineConfig(scan_layers=True), weights=weights, config=config, tokenizer=tok)
    runner = ModelRunner(plan)
    buckets = list(plan.buckets.pairs())[:n]
    fns = {"baseline": old.sample_rows, "this checkout": sampler.sample_rows}
    times = {k: [] for k in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            sampler.sample_rows = fn  # what the step traces
            jax.clear_caches()
            runner.compiled.clear()
            t0 = time.perf_counter()
            for b in buckets:
                runner.compile_bucket(b)
            times[name].append(time.perf_counter() - t0)
            print(f"round {r}: {name} {times[name][-1]:.1f} s for {len(buckets)} buckets, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    best = {k: min(v) for k, v in times.items()}
    print(f"best: baseline {best['baseline']:.1f} s, this checkout {best['this checkout']:.1f} s, "
          f"{best['baseline'] / best['this checkout']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
