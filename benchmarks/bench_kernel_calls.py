"""What a kernel call costs beyond its arithmetic: a scanned step of 120 tile products (30 layers x 4)
on one row, with weights small enough to stay in cache, so that the time is the calls' own.

    JAXSERVE_CPU_TARGET=x86-64-v3 .venv/bin/python benchmarks/bench_kernel_calls.py [--columns 16,32,256,1024]

Each layer has one Q4_1 tile matrix [576, N] (N = `--columns`), multiplied 4 times in a row by
`cpp_kernels.tile_matmul`, each output tiled into the next input. N = 16 is one tile: one thread
does the call. From 32 the tiles are shared with the helper threads (cpp/parallel_for.h), so the
difference is what handing a call's items out costs. Prints, per activations and N, the median
milliseconds of the step and the microseconds per call. Run on a quiet machine (uptime < 1), and
against another checkout by running this file from there.
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

LAYERS, CALLS, K = 30, 4, 576


def step_ms(columns: int, activations: str, rng, rounds: int) -> float:
    import gguf
    from gguf.quants import quantize

    from ir.blocks import pack_tiles

    q41 = gguf.GGMLQuantizationType.Q4_1
    stack = jnp.asarray(np.stack([pack_tiles(quantize(rng.standard_normal((columns, K), np.float32), q41), "q4_1")
                                  for _ in range(LAYERS)]))

    def step(x, tiles):
        def body(x, layer):
            for _ in range(CALLS):
                y = cpp_kernels.tile_matmul(x, tiles, "q4_1", layer=layer, activations=activations)
                x = jnp.tile(y, (1, K // columns + 1))[:, :K] * 1e-3
            return x, None
        return jax.lax.scan(body, x, jnp.arange(LAYERS, dtype=jnp.int32))[0]

    fn = jax.jit(step)
    x = jnp.asarray(rng.standard_normal((1, K)), jnp.float32)
    fn(x, stack).block_until_ready()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(x, stack).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--columns", default="16,32,256,1024")
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    cpp_kernels.ensure()
    rng = np.random.default_rng(0)
    print(f"load {os.getloadavg()[0]:.2f}")
    print("| activations | columns | step ms | us per call |")
    print("|---|---|---|---|")
    for activations in ("f32", "q8"):
        for columns in map(int, args.columns.split(",")):
            ms = step_ms(columns, activations, rng, args.rounds)
            print(f"| {activations} | {columns} | {ms:.3f} | {ms / (LAYERS * CALLS) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
