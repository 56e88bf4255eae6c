"""The serving benchmark's arrivals, in process: where each request's time to first token went.

    .venv/bin/python scripts/sim_serving.py --rate 1.0 [--max-num-seqs 16] [--rate inf] [--matmul-precision bfloat16]
        [--kv-cache-dtype bfloat16] [--quantization w8a8]

Poisson arrivals at `--rate` requests/s (the seeded gaps `runtime.bench serve` draws; inf: all at
once, the offline rate) of the `mixed` workload go straight into one LLMEngine on SmolLM2-135M
(no HTTP, so the host's share differs from the server's). Each request is traced
(`SamplingParams(trace=True)`). Prints output tok/s, TTFT percentiles, and the slowest requests'
time in the queue (arrival to first scheduled), prompt length and prefill chunks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from models.engine_config import KV_CACHE_DTYPES, MATMUL_PRECISIONS, QUANTIZATIONS  # noqa: E402
from models.weights import load_model  # noqa: E402
from runtime import SamplingParams  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.entrypoints.llm import LLM  # noqa: E402
from runtime.plan import compile_plan  # noqa: E402
from runtime.workload import make_workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (inf: all at once)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--worst", type=int, default=6, help="list this many of the slowest first tokens")
    ap.add_argument("--matmul-precision", default="float32", choices=MATMUL_PRECISIONS)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    args = ap.parse_args()
    cfg, weights, tok = load_model("smollm2-135m")
    engine_config = EngineConfig(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
                                 matmul_precision=args.matmul_precision, kv_cache_dtype=args.kv_cache_dtype,
                                 quantization=args.quantization)
    llm = LLM.from_plan(compile_plan(None, engine_config, weights=weights, config=cfg, tokenizer=tok),
                        warm_execute="auto")  # as the server starts
    engine = llm.engine
    work = make_workload("mixed", args.num_prompts, 0, args.max_model_len, cfg.vocab_size)
    llm.generate([ids for ids, _ in work[:4]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    gaps = (np.zeros(len(work)) if np.isinf(args.rate)
            else np.random.default_rng(0).exponential(1.0 / args.rate, size=len(work)))
    arrivals = np.cumsum(gaps)
    t0 = time.monotonic()
    i, done = 0, {}
    while len(done) < len(work):
        now = time.monotonic() - t0
        while i < len(work) and arrivals[i] <= now:
            ids, m = work[i]
            engine.add_request(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, trace=True),
                               arrival_time=t0 + arrivals[i])
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(max(arrivals[i] - now, 0.0), 0.01))
            continue
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    elapsed = time.monotonic() - t0
    rows = sorted(((o.trace["ttft_s"], o.trace["queue_s"], len(o.prompt_token_ids), o.trace["prefill_chunks"],
                    len(o.outputs[0].token_ids), rid) for rid, o in done.items()), reverse=True)
    ttft = np.array([r[0] for r in rows])
    out_tokens = sum(r[4] for r in rows)
    print(f"matmul_precision {args.matmul_precision}, kv_cache_dtype {args.kv_cache_dtype}, quantization {args.quantization}, rate {args.rate} req/s, "
          f"max_num_seqs {args.max_num_seqs}, {args.max_num_batched_tokens}-token steps: "
          f"{out_tokens / elapsed:.1f} output tok/s over {elapsed:.1f} s; TTFT p50 {np.median(ttft):.2f} "
          f"p90 {np.percentile(ttft, 90):.2f} p99 {np.percentile(ttft, 99):.2f} max {ttft.max():.2f} s")
    for r in rows[:args.worst]:
        print("  TTFT %.2f s = queue %.2f s + prefill; prompt %d tokens in %d chunks; %d output tokens (%s)" % r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
