"""Times the weight products of a decode step: our C++ kernels (runtime/worker/cpp/matmul.cc) against
XLA's products, in one process, rounds interleaved.

    .venv/bin/python benchmarks/bench_decode_matmul.py [--rows 1,4,8,16,32,64]
                                                    [--modes w8a8,weight-only,f32,f32-scan]
                                                    [--layers 30] [--rounds 7]

One jitted function runs the four products of each of `--layers` SmolLM2-135M layers (q/k/v
576x960, o 576x576, gate/up 576x3072, down 1536x576) on `--rows` rows, each product's output
feeding the next one's input, so that they run one after another as in a decode step. Every layer
has its own random int8 weights (106 MB for 30 layers, more than this machine's cache), so they
stream from memory as the engine's do. W8A8 compares `cpp_kernels.int8_matmul` with XLA's
s8 x s8 -> s32 dot; weight-only compares `cpp_kernels.int8_weight_matmul` with XLA's product of the
weights widened to f32 (ir.int8.weight_only_matmul without a kernel). f32 compares
`cpp_kernels.f32_matmul` with XLA's f32 dot on f32 weights (425 MB for 30 layers). f32-scan runs the
same products as a `lax.scan` over the layers' stacked weights [L, K, N], as a step scanned over
layers does: ours reads each layer in place from the stack, XLA's dot takes the scan's slice of it.
q4_1-scan does the same with GGUF Q4_1 blocks (ir.blocks; 80 MB for 30 layers): ours is
`cpp_kernels.block_matmul` on the stacked blocks, XLA's the f32 dot on the scan's slice of the
blocks' values, as a scanned step without and with `gguf_blocks` (the GB/s are each one's own bytes).
q4_1-tiles: ours is `cpp_kernels.tile_matmul` on the same blocks packed into tiles (ir.blocks.pack_tiles;
80 MB: the file's f16 scales), the int8 products of `gguf_activations=q8`, against the same XLA f32 dot.
q4_1-tiles-f32: the same tiles with f32 activations (AMX-BF16 on exact bf16 parts from 16 rows where the
CPU has it). q4_1-tiles-f32s: those products on the same values with f32 scales (Q4_K's record: 96 MB),
what the tiles read before they kept the file's f16 scales.
Prints one markdown row per row count and mode: the median milliseconds of each, the weight bytes
streamed per second, and ours vs XLA.
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


def scanned(product, ks=None):
    """The products of `chained`, in a lax.scan over the layers' stacks (one [L, K, N] per shape):
    product(x, stack, layer) reads layer `layer` of the stack; None takes the scan's slice.
    `ks`: each product's K, where the stacks are not [L, K, N] (GGUF blocks)."""
    def step(x, stacks):
        def body(x, xs):
            layer, ws = xs
            for i, stack in enumerate(stacks):
                k = stack.shape[1] if ks is None else ks[i]
                xin = jnp.tile(x, (1, k // x.shape[1] + 1))[:, :k]
                y = jnp.matmul(xin, ws[i], preferred_element_type=jnp.float32) if product is None else \
                    product(xin, stack, layer)
                x = y[:, :576] * 1e-3
            return x, None
        ids = jnp.arange(stacks[0].shape[0], dtype=jnp.int32)
        return jax.lax.scan(body, x, (ids, tuple(stacks) if product is None else None))[0]
    return jax.jit(step)


def xla_int8_dot(x, w):
    return jax.lax.dot(x, w, preferred_element_type=jnp.int32)


def xla_weight_only(x, w):
    return jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def xla_f32(x, w):
    return jnp.matmul(x, w, preferred_element_type=jnp.float32)


MODES = {"w8a8": (cpp_kernels.int8_matmul, xla_int8_dot, True),
         "weight-only": (cpp_kernels.int8_weight_matmul, xla_weight_only, False),
         "f32": (cpp_kernels.f32_matmul, xla_f32, False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--modes", default="w8a8,weight-only", help="w8a8, weight-only, f32, f32-scan, q4_1-scan, "
                    "q4_1-tiles, q4_1-tiles-f32, q4_1-tiles-f32s")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    cpp_kernels.ensure()
    rng = np.random.default_rng(0)
    modes = args.modes.split(",")
    weights, fns = {}, {}
    if {"w8a8", "weight-only"} & set(modes):
        weights["int8"] = [[jnp.asarray(rng.integers(-127, 128, s, dtype=np.int8)) for s in SHAPES]
                           for _ in range(args.layers)]
    if {"f32", "f32-scan"} & set(modes):
        f32 = [[rng.standard_normal(s, np.float32) for s in SHAPES] for _ in range(args.layers)]
        if "f32" in modes:
            weights["f32"] = [[jnp.asarray(w) for w in layer] for layer in f32]
        if "f32-scan" in modes:
            weights["f32-scan"] = [jnp.asarray(np.stack([layer[i] for layer in f32])) for i in range(len(SHAPES))]
        del f32
    if {"q4_1-scan", "q4_1-tiles", "q4_1-tiles-f32", "q4_1-tiles-f32s"} & set(modes):
        import gguf
        from gguf.quants import dequantize, quantize

        q41 = gguf.GGMLQuantizationType.Q4_1
        blocks = [[quantize(rng.standard_normal((n, k), np.float32), q41) for k, n in SHAPES]
                  for _ in range(args.layers)]
        weights["q4_1-blocks"] = [jnp.asarray(np.stack([layer[i] for layer in blocks])) for i in range(len(SHAPES))]
        weights["q4_1-f32"] = [jnp.asarray(np.stack([dequantize(layer[i], q41).T for layer in blocks]))
                               for i in range(len(SHAPES))]
        if {"q4_1-tiles", "q4_1-tiles-f32", "q4_1-tiles-f32s"} & set(modes):
            from ir.blocks import pack_tiles

            tiles = [np.stack([pack_tiles(layer[i], "q4_1") for layer in blocks]) for i in range(len(SHAPES))]
            weights["q4_1-tiles"] = [jnp.asarray(t) for t in tiles]
            if "q4_1-tiles-f32s" in modes:  # each record's f16 d and m [16] widened to f32: Q4_K's record
                from ir.blocks import BLOCK_FORMATS, TILE_COLUMNS, tile_record_bytes

                head = TILE_COLUMNS * BLOCK_FORMATS["q4_1"].scale_bytes

                def widened(t):
                    rec = t.reshape(t.shape[:-1] + (-1, tile_record_bytes("q4_1")))
                    scales = np.ascontiguousarray(rec[..., :head]).view("<f2").astype("<f4").view(np.uint8)
                    return np.concatenate([scales, rec[..., head:]], axis=-1).reshape(t.shape[:-1] + (-1,))

                weights["q4_1-tiles-f32s"] = [jnp.asarray(widened(t)) for t in tiles]
            del tiles
        del blocks
    for mode in modes:
        if mode == "q4_1-scan":
            fns[mode, "ours"] = (scanned(lambda x, s, i: cpp_kernels.block_matmul(x, s, "q4_1", layer=i),
                                         ks=[k for k, _ in SHAPES]), "q4_1-blocks")
            fns[mode, "xla"] = (scanned(None), "q4_1-f32")
            continue
        if mode in ("q4_1-tiles", "q4_1-tiles-f32", "q4_1-tiles-f32s"):
            act, fmt = ("q8", "q4_1") if mode == "q4_1-tiles" else ("f32", "q4_k" if mode == "q4_1-tiles-f32s" else "q4_1")
            fns[mode, "ours"] = (scanned(lambda x, s, i, act=act, fmt=fmt: cpp_kernels.tile_matmul(
                x, s, fmt, layer=i, activations=act), ks=[k for k, _ in SHAPES]),
                "q4_1-tiles-f32s" if mode == "q4_1-tiles-f32s" else "q4_1-tiles")
            fns[mode, "xla"] = (scanned(None), "q4_1-f32")
            continue
        if mode == "f32-scan":
            fns[mode, "ours"] = (scanned(lambda x, s, i: cpp_kernels.f32_matmul(x, s, layer=i)), mode)
            fns[mode, "xla"] = (scanned(None), mode)
            continue
        for i, who in enumerate(("ours", "xla")):
            fns[mode, who] = (chained(MODES[mode][i], MODES[mode][2]), "f32" if mode == "f32" else "int8")
    counts = args.layers * sum(k * n for k, n in SHAPES)
    nbytes = {mode: counts * (4 if mode.startswith("f32") else 1) for mode in modes}
    xla_bytes = dict(nbytes, **{m: counts * 4 for m in ("q4_1-scan", "q4_1-tiles", "q4_1-tiles-f32", "q4_1-tiles-f32s")})
    nbytes["q4_1-scan"] = nbytes["q4_1-tiles"] = nbytes["q4_1-tiles-f32"] = counts * 20 // 32
    nbytes["q4_1-tiles-f32s"] = counts * 24 // 32
    print(f"weights {counts / 1e6:.0f} M values; matmul_vectorized: {cpp_kernels.matmul_vectorized()}; "
          f"load {os.getloadavg()[0]:.2f}")
    print("| mode | rows | ours ms | ours GB/s | XLA ms | XLA GB/s | ours vs XLA |")
    print("|---|---|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, 576)), jnp.float32)
        times = {key: [] for key in fns}
        for fn, w in fns.values():
            fn(x, weights[w]).block_until_ready()
        for _ in range(args.rounds):
            for key, (fn, w) in fns.items():
                t0 = time.perf_counter()
                fn(x, weights[w]).block_until_ready()
                times[key].append(time.perf_counter() - t0)
        for mode in modes:
            ours, xla = (float(np.median(times[mode, who])) for who in ("ours", "xla"))
            print(f"| {mode} | {rows} | {ours * 1e3:.2f} | {nbytes[mode] / ours / 1e9:.1f} | {xla * 1e3:.2f} | "
                  f"{xla_bytes[mode] / xla / 1e9:.1f} | {xla / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
