"""Times the K-quants' tile products (ir.blocks: Q4_K, Q5_K, Q6_K records; runtime/worker/cpp/
tile_matmul.cc) against XLA's f32 dot on their values, on Gemma 3 270M's ffn_down (K 2048, N 640),
18 layers in a lax.scan as a scanned step runs them, in one process, rounds interleaved.

    .venv/bin/python benchmarks/bench_k_quant_tiles.py [--rows 1,8,64,512] [--formats q4_k,q5_k,q6_k]
                                                      [--activations f32,q8] [--layers 18] [--rounds 7]

Each layer's blocks are random bits (every scale and value) with moderate super-block scales, packed
by pack_tiles; XLA multiplies by their f32 values [K, N] (the dequantized weight the engine kept
before the tiles). Prints one markdown row per format, activations and row count: the median
milliseconds, the weight bytes streamed per second (the tiles', or f32's), and ours vs XLA.
Run on a quiet machine (uptime < 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_decode_matmul import scanned  # noqa: E402
from ir.blocks import KEPT_FORMATS, dequantize_tiles, pack_tiles  # noqa: E402
from runtime.worker import cpp_kernels  # noqa: E402

K, N = 2048, 640  # Gemma 3 270M's ffn_down


def random_blocks(rng, fmt: str) -> np.ndarray:
    """[N, K / 256 * block bytes]: random bits, the f16 d (and dmin) set so values are about 0.05."""
    f = KEPT_FORMATS[fmt]
    rows = rng.integers(0, 256, (N, K // 256, f.block_bytes), dtype=np.uint8)
    d = np.full((N, K // 256, 1), 1e-4, "<f2").view(np.uint8)
    if fmt == "q6_k":
        rows[..., 208:210] = d
    else:
        rows[..., 0:2] = rows[..., 2:4] = d
    return rows.reshape(N, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--formats", default="q4_k,q5_k,q6_k")
    ap.add_argument("--activations", default="f32,q8")
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    cpp_kernels.ensure()
    rng = np.random.default_rng(0)
    formats, acts = args.formats.split(","), args.activations.split(",")
    tiles, values, fns = {}, {}, {}
    for fmt in formats:
        stack = np.stack([pack_tiles(random_blocks(rng, fmt), fmt) for _ in range(args.layers)])
        tiles[fmt] = [jnp.asarray(stack)]
        values[fmt] = [dequantize_tiles(jnp.asarray(stack), fmt)]  # [L, K, N] f32
        for act in acts:
            fns[fmt, act] = scanned(lambda x, s, i, fmt=fmt, act=act: cpp_kernels.tile_matmul(
                x, s, fmt, layer=i, activations=act), ks=[K])
    xla = scanned(None)
    print(f"cpu target {cpp_kernels.cpu_target()}; load {os.getloadavg()[0]:.2f}; {args.layers} layers of "
          f"[{K} -> {N}]")
    print("| format | activations | rows | ours ms | ours GB/s | XLA f32 ms | XLA GB/s | ours vs XLA |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, 576)), jnp.float32)  # the scan tiles it to K
        runs = {key: (fn, tiles[key[0]]) for key, fn in fns.items()}
        runs |= {(fmt, "xla"): (xla, values[fmt]) for fmt in formats}
        times = {key: [] for key in runs}
        for fn, w in runs.values():
            fn(x, w).block_until_ready()
        for _ in range(args.rounds):
            for key, (fn, w) in runs.items():
                t0 = time.perf_counter()
                fn(x, w).block_until_ready()
                times[key].append(time.perf_counter() - t0)
        for fmt, act in fns:
            ours, ref = float(np.median(times[fmt, act])), float(np.median(times[fmt, "xla"]))
            print(f"| {fmt} | {act} | {rows} | {ours * 1e3:.2f} | {tiles[fmt][0].nbytes / ours / 1e9:.1f} | "
                  f"{ref * 1e3:.2f} | {values[fmt][0].nbytes / ref / 1e9:.1f} | {ref / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
