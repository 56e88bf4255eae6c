"""Times the CPU lowering of paged attention (runtime.worker.kernels.paged_attention_xla), one
layer of SmolLM2-135M's shape, on the step shapes the engine runs; optionally against another
checkout's lowering in the same process, which is the only fair comparison on a shared machine.

    .venv/bin/python benchmarks/bench_xla_attention.py [--baseline-root /path/to/other/checkout] [--bf16-pools] [--cpp]

Prints one markdown row per case: milliseconds (median of --iters), and with a baseline its
milliseconds and the largest difference between the two outputs. With --bf16-pools, also this
checkout over the same pools rounded to bf16, stored as the engine stores them on CPU
(`--kv-cache-dtype bfloat16`), against the f32 pools in the same process. With --cpp, also this
checkout with its per-row walks in our C++ kernel (`kernel_backend=cpp`), against its XLA walks,
over the f32 pools and (with --bf16-pools) over the bf16 bits.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, POOL_BLOCKS, MAX_BLOCKS = 9, 3, 64, 16, 4096, 64

# (name, bucket tokens, bucket seqs, new tokens per sequence, context per sequence after the step)
CASES = [
    ("128x16: 15 decode rows at 300 + a 113-token continuation at 400", 128, 16, [1] * 15 + [113], [301] * 15 + [513]),
    ("128x16: a 113-token continuation at 900", 128, 16, [113], [1013]),
    ("128x16: a fresh 113-token prompt + 15 decode rows at 300", 128, 16, [1] * 15 + [113], [301] * 15 + [113]),
    ("128x4: a lone prompt's 128-token chunk at 384", 128, 4, [128], [512]),
    ("128x16: 8 prefix hits, 14 new tokens each at 300", 128, 16, [14] * 8, [314] * 8),
    ("512x16: a 500-token continuation at 500", 512, 16, [500], [1000]),
    ("512x16: a fresh 500-token prompt", 512, 16, [500], [500]),
    ("16x16: 16 decode rows at 300", 16, 16, [1] * 16, [301] * 16),
    ("16x16: 16 decode rows at 20-900 (mixed)", 16, 16, [1] * 16, [20 + 58 * i for i in range(16)]),
    ("64x64: 64 decode rows at 300", 64, 64, [1] * 64, [301] * 64),
    ("64x64: 64 decode rows at 20-900 (mixed)", 64, 64, [1] * 64, [20 + 14 * i for i in range(64)]),
    ("128x16: 15 decode rows at 20-900 (mixed) + a fresh 113-token prompt", 128, 16, [1] * 15 + [113],
     [20 + 60 * i for i in range(15)] + [113]),
]


def load_baseline(root: Path):
    """`root`'s kernels module, with `root`'s tiling constants, beside this checkout's."""
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "passes" or k.startswith("passes.")}
    sys.path.insert(0, str(root))
    try:
        spec = importlib.util.spec_from_file_location("baseline_kernels", root / "runtime/worker/kernels.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k == "passes" or k.startswith("passes.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return mod


def make_case(tokens: int, seqs: int, q_lens: list[int], ctx: list[int], pool):
    rng = np.random.default_rng(1)
    q_lens = q_lens + [0] * (seqs - len(q_lens))
    ctx = ctx + [0] * (seqs - len(ctx))
    perm = rng.permutation(POOL_BLOCKS)
    tables = np.stack([perm[i * MAX_BLOCKS:(i + 1) * MAX_BLOCKS] for i in range(seqs)]).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((tokens, HEADS, HEAD_DIM), np.float32)
    k_new = rng.standard_normal((tokens, KV_HEADS, HEAD_DIM), np.float32)
    return (jnp.asarray(q), *pool, jnp.asarray(tables), jnp.asarray(np.asarray(ctx, np.int32)), jnp.asarray(cu),
            jnp.asarray(k_new), jnp.asarray(k_new))


def timed(mod, args, iters: int, **extra):
    fn = jax.jit(lambda *a: mod.paged_attention_xla(
        *a[:6], scale=HEAD_DIM ** -0.5, num_kv_heads=KV_HEADS, block_size=BLOCK, head_dim=HEAD_DIM,
        k_new=a[6], v_new=a[7], **extra))
    out = fn(*args).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-root", type=Path, default=None, help="another checkout to time in this process")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bf16-pools", action="store_true", help="also time the pools stored in bf16")
    ap.add_argument("--cpp", action="store_true", help="also time the per-row walks in our C++ kernel")
    args = ap.parse_args()
    from runtime.worker import kernels

    base = load_baseline(args.baseline_root.resolve()) if args.baseline_root else None
    rng = np.random.default_rng(0)
    shape = (POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    pool = (jnp.asarray(rng.standard_normal(shape, np.float32)), jnp.asarray(rng.standard_normal(shape, np.float32)))
    bf16_pool = None
    if args.bf16_pools:
        store = kernels.pool_storage_dtype(jnp.bfloat16, "xla")
        bf16_pool = tuple(x.astype(jnp.bfloat16) if store == jnp.bfloat16
                          else jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), store) for x in pool)
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("| step | this checkout (ms) |" + (" baseline (ms) | max diff |" if base else "")
            + (" bf16 pools (ms) | speedup | max diff |" if bf16_pool else "")
          + (" cpp (ms) | speedup | max diff |" if args.cpp else "")
          + (" cpp, bf16 pools (ms) | speedup over XLA, bf16 pools |" if args.cpp and bf16_pool else ""))
    print("|---|---|" + ("---|---|" if base else "") + ("---|---|---|" if bf16_pool else "")
          + ("---|---|---|" if args.cpp else "") + ("---|---|" if args.cpp and bf16_pool else ""))
    for name, tokens, seqs, q_lens, ctx in CASES:
        case = make_case(tokens, seqs, q_lens, ctx, pool)
        ms, out = timed(kernels, case, args.iters)
        row = f"| {name} | {ms:.2f} |"
        if base:
            ms_b, out_b = timed(base, case, args.iters)
            row += f" {ms_b:.2f} | {float(jnp.abs(out - out_b).max()):.1e} |"
        if bf16_pool:
            bf16_case = make_case(tokens, seqs, q_lens, ctx, bf16_pool)
            ms_h, out_h = timed(kernels, bf16_case, args.iters)
            row += f" {ms_h:.2f} | {ms / ms_h:.2f}x | {float(jnp.abs(out - out_h).max()):.1e} |"
        if args.cpp:
            ms_c, out_c = timed(kernels, case, args.iters, row_kernel=True)
            row += f" {ms_c:.2f} | {ms / ms_c:.2f}x | {float(jnp.abs(out - out_c).max()):.1e} |"
            if bf16_pool:
                ms_ch, _ = timed(kernels, bf16_case, args.iters, row_kernel=True)
                row += f" {ms_ch:.2f} | {ms_h / ms_ch:.2f}x |"
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
