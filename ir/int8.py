"""The numerics of matmul_int8: weight-only (quantization=int8), the int8 weights widened to the
activations' dtype; and W8A8 (`activations="i8"`, quantization=w8a8), each row of the activations
quantized to int8 at run time, an int8 x int8 product with int32 accumulation. Both scale the
output columns by the weights' per-channel scales."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# matmul_int8's `activations` value that asks for per-row int8 activations.
INT8_ACTIVATIONS = "i8"
# Rows below which a W8A8 product is padded with zero rows: XLA:CPU's int8 GEMM runs one row
# 10x slower than 2-4 rows (docs/benchmarks/, "W8A8"), and a padded row costs next to nothing.
W8A8_MIN_ROWS = 4


def quantize_rows_int8(x):
    """Symmetric per-row int8 of x [..., K]: (q int8, scale f32 [..., 1]) with x ~= q * scale;
    an all-zero row gets scale 1."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(xf / scale), -127, 127).astype(jnp.int8), scale


def w8a8_matmul(x, w, scale, min_rows: int = W8A8_MIN_ROWS, product=None):
    """x [..., K] @ (w int8 [K, N] * scale [N]): each row quantized with its own scale, an int8 x
    int8 -> int32 product, then both scales; in x's dtype. Steps of fewer than `min_rows` rows
    are padded for XLA's dot (zero rows quantize to zeros, and are dropped after the product).
    `product(q [rows, K] s8, w) -> s32 [rows, N]` replaces XLA's dot (a backend's kernel; the
    int32 sums are exact, so any exact product gives the same result), without the padding; w is
    then whatever `product` takes (a layer stack [L, K, N], for one)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    x2 = x.reshape(rows, k)
    if product is None and rows < min_rows:
        x2 = jnp.pad(x2, ((0, min_rows - rows), (0, 0)))
    q, row_scale = quantize_rows_int8(x2)
    if product is None:
        acc = jax.lax.dot(q, w, preferred_element_type=jnp.int32)
    else:
        acc = product(q, w)
    y = acc[:rows].astype(jnp.float32) * row_scale[:rows] * scale.astype(jnp.float32)
    return y.reshape(lead + (w.shape[-1],)).astype(x.dtype)


def weight_only_matmul(x, w, scale, product=None):
    """x [..., K] @ (w int8 [K, N] * scale [N]), in x's dtype: w widened to x's dtype, the product
    accumulated in f32, then the column scales. `product(x [rows, K], w) -> f32 [rows, N]` replaces
    XLA's matmul (a backend's kernel that widens w as it reads it; w is then whatever it takes)."""
    if product is None:
        y = jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    else:
        lead, k = x.shape[:-1], x.shape[-1]
        y = product(x.reshape(math.prod(lead), k), w).reshape(lead + (w.shape[-1],))
    return (y * scale.astype(jnp.float32)).astype(x.dtype)
