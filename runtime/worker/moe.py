"""The mixture-of-experts lowering: moe_experts (ir.moe_ops) by expert groups on kernels.grouped_matmul,
and its per-device form under tensor or expert parallelism."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ir.moe_ops import EXPERT_ACTS
from runtime.worker.kernels import grouped_matmul


def _tied(w, dtype, sizes):
    """`w` cast to `dtype`, tied to this layer's routing (`sizes`, the per-expert counts: adding
    0 x (sizes[0] < 0)) as matmul_half_cpu ties its widened weight to the activations, so that XLA
    makes this copy when the layer runs rather than every layer's at the top of the step. The
    counts are replicated under tensor parallelism, so the tie moves nothing between devices."""
    return w.astype(dtype) + (sizes[0] < 0).astype(dtype) * 0


def moe_experts_grouped(x, ids, weights, wg, wu, wd, *scales, act="silu", backend="xla"):
    """moe_experts (ir.moe_ops) by expert groups: the T x k token-expert pairs sorted by expert,
    each product one grouped_matmul under `backend` (jax.lax.ragged_dot's contract: lhs [M, K], rhs
    [G, K, N], group_sizes [G] -> [M, N]; rows of group g are the g-th run of lhs), then the rows
    put back in pair order and summed per token with their router weights. Static shapes: M = T x k
    rows whatever the routing, so a step never recompiles when the per-expert counts change, and
    the work grows with k, not with E. Int8 experts (three scales [E, out]) multiply by the int8
    stack widened to the activations' dtype (one layer's at a time), then scale each row by its
    expert's column scales: exactly x @ (w_int8 * s)."""
    t, k = ids.shape
    num_experts = wg.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # [T*k] pair index, by expert
    experts = jnp.take(flat, order)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    sg, su, sd = scales if scales else (None, None, None)

    def product(lhs, w, scale):
        if w.dtype != lhs.dtype:
            w = _tied(w, lhs.dtype, sizes)
        y = grouped_matmul(lhs, w, sizes, backend=backend).astype(jnp.float32)
        return y if scale is None else y * jnp.take(scale, experts, axis=0, mode="clip")

    rows = jnp.take(x, order // k, axis=0)  # [T*k, H]
    hidden = EXPERT_ACTS[act](product(rows, wg, sg)) * product(rows, wu, su)  # [T*k, I] f32
    y = product(hidden.astype(x.dtype), wd, sd) * jnp.take(weights.reshape(-1), order)[:, None]
    y = jnp.zeros_like(y).at[order].set(y, unique_indices=True)  # back in pair order
    return jnp.sum(y.reshape(t, k, -1), axis=1).astype(x.dtype)


def moe_experts_on_device(x, ids, weights, wg, wu, wd, *scales, num_experts, axis, act="silu", backend="xla"):
    """moe_experts on one device's shards, inside shard_map over mesh axis `axis`, its partial sum
    all-reduced: tokens and routing replicated; each expert split by its intermediate dim (tensor
    parallel: every device runs every pair on its columns), or the experts split among the devices
    (expert parallel: this device holds experts [offset, offset + local); a pair routed elsewhere
    becomes a row past the last group, which no expert multiplies, and weighs 0). Either way the
    one all-reduce is of [T, hidden], after the rows are summed per token."""
    local = wg.shape[0]
    if local < num_experts:
        rel = ids - jax.lax.axis_index(axis) * local
        mine = (rel >= 0) & (rel < local)
        ids, weights = jnp.where(mine, rel, local), jnp.where(mine, weights, 0.0)
    y = moe_experts_grouped(x, ids, weights, wg, wu, wd, *scales, act=act, backend=backend)
    return jax.lax.psum(y, axis)


def per_device_lowerings(backend: str) -> dict:
    """op name -> (node -> implementation on one device's shards, taking `axis`) for the ops whose
    sharded form runs per device in shard_map and all-reduces its own result (see
    runtime.worker.sharding.TensorParallelMesh.per_device)."""
    return {"moe_experts": lambda node: functools.partial(moe_experts_on_device, num_experts=node.inputs[3].shape[0],
                                                          backend=backend)}


def lowerings(backend: str) -> dict:
    """op name -> implementation under `backend` (beside kernels.lowerings' attention ops)."""
    return {"moe_experts": functools.partial(moe_experts_grouped, backend=backend)}
