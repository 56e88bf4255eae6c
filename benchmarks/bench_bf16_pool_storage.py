"""A bf16 plan (`--dtype bfloat16`) on CPU with its KV pools stored as bf16 against the same plan
with them stored as uint16 bits (runtime.worker.kernels.pool_storage_dtype), in one process.

    .venv/bin/python benchmarks/bench_bf16_pool_storage.py [--rounds 3]

The first engine is built with the storage rule switched off, as before 18c244f: XLA:CPU then
widens the whole pool to f32 for every bf16 gather and scatter. Case: 16 sequences of 64-token
prompts decoding 32 tokens (run to 1 and to 33 tokens; the difference is 32 decode steps), 2,000
KV blocks, 128-token steps, no prefix caching. Prints one JSON line.
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
from config.engine_config import EngineConfig  # noqa: E402
from runtime.entrypoints.llm import LLM  # noqa: E402
from runtime.engine.plan import compile_plan  # noqa: E402
from runtime.worker import kernels  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cfg, weights, tok = load_model("smollm2-135m")
    rule = kernels.pool_storage_dtype
    engine = EngineConfig(dtype="bfloat16", max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=128,
                          num_kv_blocks=2000, enable_prefix_caching=False)
    llms = {}
    for name in ("bf16 pools", "uint16 bits"):
        kernels.pool_storage_dtype = (lambda dtype, backend: dtype) if name == "bf16 pools" else rule
        try:
            llms[name] = LLM.from_plan(compile_plan(None, engine, weights=weights, config=cfg, tokenizer=tok))
        finally:
            kernels.pool_storage_dtype = rule
    rng = np.random.default_rng(0)
    greedy = lambda m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731
    runs = {k: [] for k in llms}
    for _ in range(args.rounds):
        prompts = [rng.integers(100, 40000, 64).tolist() for _ in range(16)]
        for name, llm in llms.items():
            t0 = time.perf_counter()
            llm.generate(prompts, greedy(1))
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.generate(prompts, greedy(33))
            runs[name].append(16 * 32 / (time.perf_counter() - t0 - first))
    print(json.dumps({"case": "bf16 plan, 16 sequences decoding", "unit": "tok/s",
                      **{k: round(statistics.median(v), 1) for k, v in runs.items()},
                      "rounds": {k: [round(x, 1) for x in v] for k, v in runs.items()},
                      "pool_dtypes": {k: sorted({str(x.dtype) for x in llm.engine.runner.state.values()})
                                      for k, llm in llms.items()},
                      "load_avg_1m": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
