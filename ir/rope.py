"""RoPE's inverse frequencies, with HF's scaling rules: the numerics of the `rope` op (ir.ops)."""

from __future__ import annotations

import jax.numpy as jnp


def rope_inv_freq(head_dim: int, theta: float, scaling) -> jnp.ndarray:
    """RoPE inverse frequencies, with HF's `linear` and `llama3` scaling rules."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    rs = dict(scaling or ())
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        factor = float(rs["factor"])
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_len = float(rs.get("original_max_position_embeddings", 8192))
        wavelen = 2 * jnp.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = jnp.where(wavelen > old_len / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = jnp.where(is_mid, mid, scaled)
    return inv
