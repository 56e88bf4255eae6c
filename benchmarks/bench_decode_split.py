"""Times our C++ decode-attention kernel alone (runtime.worker.cpp_kernels.paged_decode) on steps of
few rows at long context, one layer of SmolLM2-135M's heads, with each row's walk split over the
threads (the default `part_tokens`) against one row per thread (`--base-part-tokens 0`), in one
process, over f32 pools and bf16 bits.

    .venv/bin/python benchmarks/bench_decode_split.py [--base-part-tokens 0] [--part-tokens 256] [--iters 30]

The last cases put one long row after short ones. Prints one JSON line per (rows, context, pool):
medians in ms, the speedup, and the largest difference between the two outputs (attention output,
acc / den).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from runtime.worker import cpp_kernels  # noqa: E402

KV_HEADS, REP, HEAD_DIM, BLOCK, POOL_BLOCKS, MAX_BLOCKS = 3, 3, 64, 16, 4096, 600
# (rows, context): every row at that context; or (rows, [long, short]): one row at the long context
# after rows - 1 at the short one (a long chat in a batch of short ones, last in the step's order).
CASES = [(1, 512), (1, 1000), (1, 3000), (1, 8000), (2, 3000), (4, 3000), (8, 1000), (64, 300),
         (4, [3000, 100]), (8, [8000, 100]), (16, [4000, 200]), (64, [8000, 300])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-part-tokens", type=int, default=0)
    ap.add_argument("--part-tokens", type=int, default=cpp_kernels.PART_TOKENS)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = (POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    kf, vf = (jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(2))
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)  # noqa: E731
    pools = {"f32": (kf, vf), "bf16": (bits(kf), bits(vf))}
    perm = rng.permutation(POOL_BLOCKS)
    variants = {"base": args.base_part_tokens, "variant": args.part_tokens}
    print(json.dumps({"load_avg_1m": round(os.getloadavg()[0], 2), "part_tokens": variants}), flush=True)
    for rows, ctx in CASES:
        tables = jnp.asarray(np.stack([np.roll(perm, 37 * i)[:MAX_BLOCKS] for i in range(rows)]).astype(np.int32))
        q = jnp.asarray(rng.standard_normal((rows, KV_HEADS, REP, HEAD_DIM), np.float32))
        lens = [ctx] * rows if isinstance(ctx, int) else ctx[1:] * (rows - 1) + ctx[:1]
        seq, limit = jnp.arange(rows, dtype=jnp.int32), jnp.asarray(lens, jnp.int32)
        for pool_name, (k, v) in pools.items():
            fns = {name: jax.jit(lambda *a, n=n: cpp_kernels.paged_decode(*a, part_tokens=n))
                   for name, n in variants.items()}
            outs = {name: f(q, k, v, tables, seq, limit) for name, f in fns.items()}
            times = {name: [] for name in fns}
            for _ in range(args.iters):  # interleaved
                for name, f in fns.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(q, k, v, tables, seq, limit))
                    times[name].append(time.perf_counter() - t0)
            med = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
            out = {name: o[2] / o[1][..., None] for name, o in outs.items()}
            print(json.dumps({"rows": rows, "context": ctx, "pool": pool_name,
                              **{f"{name}_ms": round(m, 3) for name, m in med.items()},
                              "speedup": round(med["base"] / med["variant"], 2),
                              "max_diff": float(jnp.abs(out["base"] - out["variant"]).max())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
