"""Times the int8-weight products of a decode step: our C++ kernels (runtime/worker/cpp/int8_matmul.cc)
against XLA's products, in one process, rounds interleaved.

    .venv/bin/python scripts/bench_int8_matmul.py [--rows 1,4,8,16,32,64] [--modes w8a8,weight-only]
                                                  [--layers 30] [--rounds 7]

One jitted function runs the four products of each of `--layers` SmolLM2-135M layers (q/k/v
576x960, o 576x576, gate/up 576x3072, down 1536x576) on `--rows` rows, each product's output
feeding the next one's input, so that they run one after another as in a decode step. Every layer
has its own random int8 weights (106 MB for 30 layers, more than this machine's cache), so they
stream from memory as the engine's do. W8A8 compares `cpp_kernels.int8_matmul` with XLA's
s8 x s8 -> s32 dot; weight-only compares `cpp_kernels.int8_weight_matmul` with XLA's product of the
weights widened to f32 (ir.int8.weight_only_matmul without a kernel). Prints one markdown row per
row count: the median milliseconds of each, the weight bytes streamed per second, and ours vs XLA.
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from runtime.worker import cpp_kernels  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N) of one layer's products


def chained(product, int8_rows: bool):
    """A step's products, one after another: each input is the previous output's first 576
    columns, tiled to the next K (rounded to int8 for W8A8)."""
    def step(x, layers):
        for weights in layers:
            for w in weights:
                k = w.shape[0]
                xin = jnp.tile(x, (1, k // x.shape[1] + 1))[:, :k]
                if int8_rows:
                    xin = jnp.clip(jnp.round(xin), -127, 127).astype(jnp.int8)
                x = product(xin, w).astype(jnp.float32)[:, :576] * 1e-3
        return x
    return jax.jit(step)


def xla_int8_dot(x, w):
    return jax.lax.dot(x, w, preferred_element_type=jnp.int32)


def xla_weight_only(x, w):
    return jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32)


MODES = {"w8a8": (cpp_kernels.int8_matmul, xla_int8_dot, True),
         "weight-only": (cpp_kernels.int8_weight_matmul, xla_weight_only, False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--modes", default="w8a8,weight-only")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    cpp_kernels.ensure()
    rng = np.random.default_rng(0)
    layers = [[jnp.asarray(rng.integers(-127, 128, s, dtype=np.int8)) for s in SHAPES] for _ in range(args.layers)]
    nbytes = args.layers * sum(k * n for k, n in SHAPES)
    modes = args.modes.split(",")
    fns = {(mode, who): chained(MODES[mode][i], MODES[mode][2]) for mode in modes for i, who in enumerate(("ours", "xla"))}
    print(f"weights {nbytes / 1e6:.0f} MB; int8_matmul_vectorized: {cpp_kernels.int8_matmul_vectorized()}; "
          f"load {os.getloadavg()[0]:.2f}")
    print("| mode | rows | ours ms | ours GB/s | XLA ms | XLA GB/s | ours vs XLA |")
    print("|---|---|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, 576)), jnp.float32)
        times = {key: [] for key in fns}
        for fn in fns.values():
            fn(x, layers).block_until_ready()
        for _ in range(args.rounds):
            for key, fn in fns.items():
                t0 = time.perf_counter()
                fn(x, layers).block_until_ready()
                times[key].append(time.perf_counter() - t0)
        for mode in modes:
            ours, xla = (float(np.median(times[mode, who])) for who in ("ours", "xla"))
            print(f"| {mode} | {rows} | {ours * 1e3:.2f} | {nbytes / ours / 1e9:.1f} | {xla * 1e3:.2f} | "
                  f"{nbytes / xla / 1e9:.1f} | {xla / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
