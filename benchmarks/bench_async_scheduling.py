"""Async scheduling on and off, on one SmolLM2-135M engine in one process (the flag is toggled
between rounds, so both modes run the same executables), in alternating rounds.

    .venv/bin/python benchmarks/bench_async_scheduling.py [--rounds 3] [--cases 1,16,64]

Each case decodes `--new` tokens (greedy, `ignore_eos`, detokenized as a user would get them) after
32-token prompts, for 1, 16 or 64 sequences at once; new prompts each round (the prefix cache is
off anyway). Prints one JSON line per case: output tok/s, the median of the rounds, on / off, and
the host time per step left on the critical path (`runtime.tools.bench.step_breakdown`).
Run on a quiet machine (uptime < 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from models.weights import load_model  # noqa: E402
from runtime import SamplingParams  # noqa: E402
from runtime.tools.bench import step_breakdown  # noqa: E402
from config.engine_config import EngineConfig  # noqa: E402
from runtime.entrypoints.llm import LLM  # noqa: E402
from runtime.engine.plan import compile_plan  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="1,16,64", help="sequences at once, comma-separated")
    ap.add_argument("--new", type=int, default=64, help="tokens generated per sequence")
    args = ap.parse_args()
    cfg, weights, tok = load_model("smollm2-135m")
    plan = compile_plan(None, EngineConfig(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=512,
                                           num_kv_blocks=600, enable_prefix_caching=False),
                        weights=weights, config=cfg, tokenizer=tok)
    llm = LLM.from_plan(plan)
    engine = llm.engine
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    for n in [int(x) for x in args.cases.split(",")]:
        rates = {True: [], False: []}
        breakdown = {}
        for mode in (True, False):  # warm both paths
            engine.async_scheduling = mode
            llm.generate([rng.integers(100, 40000, 32).tolist() for _ in range(n)], params)
        for r in range(args.rounds):
            prompts = [rng.integers(100, 40000, 32).tolist() for _ in range(n)]
            for mode in ((True, False) if r % 2 == 0 else (False, True)):
                engine.async_scheduling = mode
                engine.trace = []
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                dt = time.perf_counter() - t0
                rates[mode].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
                breakdown.setdefault(mode, []).append(step_breakdown(engine.trace[1:]))  # decode steps
                engine.trace = None
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        med = lambda mode, k: round(statistics.median(b[k] for b in breakdown[mode]), 2)  # noqa: E731
        print(json.dumps({
            "sequences": n, "new_tokens": args.new, "async_tok_s": round(on, 1), "sync_tok_s": round(off, 1),
            "async_vs_sync": round(on / off, 3), "rounds_async": [round(x, 1) for x in rates[True]],
            "rounds_sync": [round(x, 1) for x in rates[False]],
            "host_ms_per_step": {"async": med(True, "host"), "sync": med(False, "host")},
            "host_exposed_ms_per_step": {"async": med(True, "host_exposed"), "sync": med(False, "host_exposed")},
            "device_wait_ms_per_step": {"async": med(True, "device"), "sync": med(False, "device")},
            "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
