"""64 sequences x 64 new tokens (greedy, SmolLM2-135M, CPU) from one checkout's code, for comparing
two checkouts whose C++ kernels differ: one process holds one build of the kernel library, so
benchmarks/bench_ab.py cannot put them side by side. Run it in alternating processes instead:

    git worktree add /tmp/base PARENT
    for i in 1 2 3; do for root in /tmp/base .; do
        .venv/bin/python benchmarks/bench_seqs64.py --root $root --rounds 5; done; done

Each process warms up on one batch, then times `--rounds` batches of 64 new 64-token prompts
(bench_ab.py's seqs64 case) and prints the rates and their median. Engine fields can be given as
KEY=VALUE (integers, true/false or strings). Run on a quiet machine (uptime < 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench_engine_args import COMMON, parse_pairs

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAXSERVE_EXECUTABLE_STORE"] = "0"  # the store's key cannot tell two checkouts' kernels apart


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the checkout to run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("fields", nargs="*", metavar="KEY=VALUE", help="EngineConfig fields")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.root).resolve()))
    import numpy as np

    from runtime import SamplingParams
    from runtime.entrypoints.llm import LLM

    llm = LLM("smollm2-135m", **(COMMON | parse_pairs(args.fields)))
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    batch = lambda: [rng.integers(100, 40000, 64).tolist() for _ in range(64)]  # noqa: E731
    llm.generate(batch(), params)
    rates = []
    for _ in range(args.rounds):
        prompts = batch()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        rates.append(64 * 64 / (time.perf_counter() - t0))
    print(f"{args.root}: 64 sequences x 64 tokens, tok/s {[round(r, 1) for r in rates]}, "
          f"median {statistics.median(rates):.1f} (load {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
