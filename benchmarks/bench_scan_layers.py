"""Scan over layers vs unrolled on SmolLM2-135M: cold compile, warm load, and step times (A/B).

    .venv/bin/python benchmarks/bench_scan_layers.py startup   # 19 buckets, empty caches: cold, then warm
    .venv/bin/python benchmarks/bench_scan_layers.py startup int8   # the same, quantization=int8
    .venv/bin/python benchmarks/bench_scan_layers.py steps     # interleaved step timings, one process

Numbers for docs/benchmarks/ ("Scan over layers"). Run on a quiet machine; one heavy job at a time.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from models.config import get_preset  # noqa: E402
from models.weights import load_model, random_weights  # noqa: E402
from runtime.engine.plan import compile_plan  # noqa: E402
from config.engine_config import EngineConfig  # noqa: E402
from runtime.engine.build import build_runner  # noqa: E402


def startup(quantization: str | None = None) -> dict:
    cfg, w, tok = load_model("smollm2-135m")
    res = {"quantization": quantization}
    for scan in (True, False):
        cache = tempfile.mkdtemp(prefix=f"scan_{scan}_")
        plan = compile_plan(None, EngineConfig(scan_layers=scan, quantization=quantization), weights=w, config=cfg,
                            tokenizer=tok)
        t0 = time.perf_counter()
        build_runner(plan, cache).warmup()
        cold = time.perf_counter() - t0
        jax.clear_caches()
        t0 = time.perf_counter()
        build_runner(plan, cache).warmup()
        res["scan" if scan else "unrolled"] = dict(buckets=len(plan.buckets.pairs()), cold_compile_s=round(cold, 1),
                                                   warm_load_s=round(time.perf_counter() - t0, 1))
    return res


def _inputs(runner, bucket, num_seqs, num_tokens, ctx):
    a = {k: np.zeros(v.shape, v.dtype) for k, v in runner.input_specs(*bucket).items()}
    a["slot_mapping"][:] = -1
    per = num_tokens // num_seqs
    for i in range(num_seqs):
        rows, pos, base = slice(i * per, (i + 1) * per), np.arange(ctx - per, ctx), i * 20
        a["tokens"][rows], a["positions"][rows] = 5, pos
        a["block_tables"][i, :20] = np.arange(base, base + 20)
        a["slot_mapping"][rows] = (base + pos // 16) * 16 + pos % 16
        a["context_lens"][i], a["cu_q_lens"][i + 1:], a["logits_indices"][i] = ctx, (i + 1) * per, (i + 1) * per - 1
    return a


def steps(rounds: int = 4) -> dict:
    cfg = get_preset("smollm2-135m")
    w = random_weights(cfg, seed=0)
    cases = {"decode 1 seq (8x4)": ((8, 4), 1, 1, 300), "decode 64 seqs (64x64)": ((64, 64), 64, 64, 300),
             "prefill 128 tok (128x16)": ((128, 16), 1, 128, 128)}
    runners = {}
    for scan in (True, False):
        plan = compile_plan(None, EngineConfig(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=128,
                                               num_kv_blocks=1200, scan_layers=scan), weights=w, config=cfg)
        runners[scan] = build_runner(plan)
    times = {name: {True: [], False: []} for name in cases}
    for _ in range(rounds):  # interleaved, so load changes hit both alike
        for name, (bucket, n, t, ctx) in cases.items():
            for scan, r in runners.items():
                r.compile_bucket(bucket)
                a = _inputs(r, bucket, n, t, ctx)
                jax.block_until_ready(r.execute(bucket, a)["tokens"])
                for _ in range(3):
                    t0 = time.perf_counter()
                    jax.block_until_ready(r.execute(bucket, a)["tokens"])
                    times[name][scan].append(time.perf_counter() - t0)
    return {name: {"scan_ms": round(float(np.median(v[True])) * 1e3, 1),
                   "unrolled_ms": round(float(np.median(v[False])) * 1e3, 1)} for name, v in times.items()}


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "startup"
    print(json.dumps(startup(*sys.argv[2:3]) if what == "startup" else steps(), indent=1))
