"""`matmul_precision` float32 against bfloat16 on SmolLM2-135M (f32 plan, greedy, CPU), in one
process: two engines over the same weights, rounds interleaved, medians.

    .venv/bin/python scripts/bench_matmul_precision.py [--rounds 3] [--skip-batch]

- TTFT of a 512-token prompt (`max_tokens=1`, a new prompt each round);
- batch-1 decode rate: 128 tokens after a 32-token prompt (`ignore_eos`);
- 64 sequences x 64 tokens (new prompts each round, so the prefix cache never hits);
- greedy agreement: of the 64 sequences' first round, how many generated the same 64 tokens.
Run on a quiet machine (uptime < 1); prints one JSON line per measurement.
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

from models.engine_config import MATMUL_PRECISIONS as PRECISIONS  # noqa: E402
from models.weights import load_model  # noqa: E402
from runtime import SamplingParams  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.entrypoints.llm import LLM  # noqa: E402
from runtime.plan import compile_plan  # noqa: E402



def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-batch", action="store_true", help="skip the 64-sequence case (the slowest)")
    args = ap.parse_args()
    cfg, weights, tok = load_model("smollm2-135m")
    llms = {}
    for prec in PRECISIONS:
        plan = compile_plan(None, EngineConfig(max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=512,
                                               num_kv_blocks=2000, matmul_precision=prec),
                            weights=weights, config=cfg, tokenizer=tok)
        llms[prec] = LLM.from_plan(plan)
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(100, 40000, n).tolist()  # noqa: E731
    greedy = lambda m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731

    def report(name, runs, unit, higher_is_better, **extra):
        med = {p: statistics.median(v) for p, v in runs.items()}
        ratio = med["bfloat16"] / med["float32"] if higher_is_better else med["float32"] / med["bfloat16"]
        print(json.dumps({"case": name, "unit": unit, **{p: round(m, 3) for p, m in med.items()},
                          "bf16_speedup": round(ratio, 2), "rounds": {p: [round(x, 3) for x in v] for p, v in runs.items()},
                          "load_avg_1m": round(os.getloadavg()[0], 2), **extra}), flush=True)

    runs = {p: [] for p in PRECISIONS}
    for llm in llms.values():
        llm.generate([prompt(512)], greedy(1))
    for _ in range(args.rounds):
        p = prompt(512)
        for prec, llm in llms.items():
            runs[prec].append(timed(lambda: llm.generate([p], greedy(1))))
    report("TTFT, 512-token prompt", runs, "s", higher_is_better=False)

    p = prompt(32)
    runs = {p: [] for p in PRECISIONS}
    for llm in llms.values():
        llm.generate([p], greedy(128))
    for _ in range(args.rounds):
        for prec, llm in llms.items():
            ttft = timed(lambda: llm.generate([p], greedy(1)))
            runs[prec].append(127 / (timed(lambda: llm.generate([p], greedy(128))) - ttft))
    report("batch-1 decode", runs, "tok/s", higher_is_better=True)

    if not args.skip_batch:
        runs = {p: [] for p in PRECISIONS}
        for llm in llms.values():
            llm.generate([prompt(64) for _ in range(64)], greedy(64))
        same = None
        for _ in range(args.rounds):
            prompts = [prompt(64) for _ in range(64)]
            outs = {}
            for prec, llm in llms.items():
                runs[prec].append(64 * 64 / timed(lambda: outs.__setitem__(prec, llm.generate(prompts, greedy(64)))))
            if same is None:
                same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
                           for a, b in zip(outs["float32"], outs["bfloat16"]))
        report("64 sequences x 64 tokens", runs, "tok/s", higher_is_better=True, same_greedy_tokens=f"{same}/64")
    return 0


if __name__ == "__main__":
    sys.exit(main())
