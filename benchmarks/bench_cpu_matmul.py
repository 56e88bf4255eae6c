"""What XLA:CPU's matmuls do on this machine at SmolLM2-135M's shapes: the numbers behind the
one-token bucket (runtime/core/buckets.py) and the compute limit of batched decode (docs/benchmarks/).

    .venv/bin/python benchmarks/bench_cpu_matmul.py

- Weight streaming at M rows: 30 MLP-like layers (576 -> 1536 -> 576, f32) and the tied LM head
  (576 x 49,152), as GB/s of weights read; one row takes XLA:CPU's matrix-vector path. The same
  with bf16 weights and inputs, f32 accumulation (`matmul_precision=bfloat16`'s wide-step path):
  the rows from which it wins set passes.bf16_matmuls.BF16_MIN_ROWS. And one row from bf16 weights
  stored [out, in], the layout in which XLA:CPU's bf16 matrix-vector product is fast. And W8A8
  (`quantization=w8a8`): int8 weights, each row of the activations quantized to int8, an int8 x
  int8 -> int32 product, through the engine's own op (ir.ops matmul_int8), which pads steps of
  fewer than W8A8_MIN_ROWS rows; `w8a8_unpadded_*` is the same product without the padding.
- GEMM throughput, f32 and bf16 (f32 accumulation), in GFLOP/s at M = 1, 64 and 512.
Medians; run on a quiet machine (uptime < 1). Prints one JSON line per measurement.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ir import OPS  # noqa: E402
from ir.int8 import INT8_ACTIVATIONS, w8a8_matmul  # noqa: E402
from runtime.worker.params import quantize_int8_weight  # noqa: E402

HIDDEN, FFN, VOCAB, LAYERS = 576, 1536, 49152, 30


def median_s(fn, *args, n: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    rng = np.random.default_rng(0)
    ups = [jnp.asarray(rng.standard_normal((HIDDEN, FFN)) * 0.02, jnp.float32) for _ in range(LAYERS)]
    downs = [jnp.asarray(rng.standard_normal((FFN, HIDDEN)) * 0.02, jnp.float32) for _ in range(LAYERS)]
    head = jnp.asarray(rng.standard_normal((HIDDEN, VOCAB)) * 0.02, jnp.float32)

    def dot(x, w):  # bf16 weights: bf16 inputs, f32 accumulation
        return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)

    @jax.jit
    def layers(x, ups, downs):
        for up, down in zip(ups, downs):
            x = x + dot(jax.nn.silu(dot(x, up)), down)
        return x

    logits = jax.jit(dot)
    as_bf16 = lambda ws: [w.astype(jnp.bfloat16) for w in ws]  # noqa: E731
    ups_b, downs_b, head_b = as_bf16(ups), as_bf16(downs), head.astype(jnp.bfloat16)
    layer_bytes = sum(w.nbytes for w in ups + downs)

    def as_int8(w):
        q, scale = quantize_int8_weight(np.asarray(w))
        return jnp.asarray(q), jnp.asarray(scale)

    ups_q, downs_q, head_q = [as_int8(w) for w in ups], [as_int8(w) for w in downs], as_int8(head)

    def w8a8(x, wq, padded=True):
        if padded:
            return OPS["matmul_int8"].impl(x, *wq, activations=INT8_ACTIVATIONS)
        return w8a8_matmul(x, *wq, min_rows=1)

    def layers_w8a8(padded):
        def f(x, ups, downs):
            for up, down in zip(ups, downs):
                x = x + w8a8(jax.nn.silu(w8a8(x, up, padded)), down, padded)
            return x
        return jax.jit(f)

    logits_w8a8 = jax.jit(w8a8)
    for m in (1, 2, 3, 4, 8, 16, 64):
        x = jnp.ones((m, HIDDEN), jnp.float32)
        t_layers, t_head = median_s(layers, x, ups, downs), median_s(logits, x, head)
        tb_layers, tb_head = median_s(layers, x, ups_b, downs_b), median_s(logits, x, head_b)
        tq_layers, tq_head = median_s(layers_w8a8(True), x, ups_q, downs_q), median_s(logits_w8a8, x, head_q)
        row = {"case": "weight streaming", "rows": m, "layers_ms": round(t_layers * 1e3, 2),
               "layers_GBps": round(layer_bytes / t_layers / 1e9, 1), "head_ms": round(t_head * 1e3, 2),
               "head_GBps": round(head.nbytes / t_head / 1e9, 1),
               "bf16_layers_ms": round(tb_layers * 1e3, 2), "bf16_head_ms": round(tb_head * 1e3, 2),
               "w8a8_layers_ms": round(tq_layers * 1e3, 2), "w8a8_head_ms": round(tq_head * 1e3, 2)}
        if m == 1:
            row["w8a8_unpadded_layers_ms"] = round(median_s(layers_w8a8(False), x, ups_q, downs_q) * 1e3, 2)
        print(json.dumps(row), flush=True)
    # One row from bf16 weights stored [out, in] (x @ w.T): XLA:CPU's bf16 matrix-vector path is
    # fast only in this layout (and slow in it from two rows up).
    ups_t, downs_t = [w.T.copy() for w in ups_b], [w.T.copy() for w in downs_b]
    head_t = head_b.T.copy()
    layers_t = jax.jit(lambda x, ups, downs: layers(x, [u.T for u in ups], [d.T for d in downs]))
    logits_t = jax.jit(lambda x, w: dot(x, w.T))
    x = jnp.ones((1, HIDDEN), jnp.float32)
    t_layers, t_head = median_s(layers_t, x, ups_t, downs_t), median_s(logits_t, x, head_t)
    print(json.dumps({"case": "one row, bf16 weights stored [out, in]", "layers_ms": round(t_layers * 1e3, 2),
                      "head_ms": round(t_head * 1e3, 2)}), flush=True)
    for m in (1, 64, 512):
        for dtype in (jnp.float32, jnp.bfloat16):
            x = jnp.asarray(rng.standard_normal((m, HIDDEN)), dtype)
            w = jnp.asarray(rng.standard_normal((HIDDEN, VOCAB)), dtype)
            f = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
            t = median_s(f, x, w, n=10)
            print(json.dumps({"case": "gemm", "rows": m, "dtype": jnp.dtype(dtype).name, "ms": round(t * 1e3, 2),
                              "GFLOPs": round(2 * m * HIDDEN * VOCAB / t / 1e9, 1)}), flush=True)
    print(json.dumps({"load_avg_1m": round(os.getloadavg()[0], 2), "jax": jax.__version__}))


if __name__ == "__main__":
    main()
