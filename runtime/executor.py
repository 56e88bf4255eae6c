"""Graph -> jitted JAX step function: each IR op lowered to its jnp reference or a Pallas kernel."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ir import OPS, Graph
from passes.shard import SHARDING_ATTRS

JNP_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "i32": jnp.int32,
              "i8": jnp.int8, "bool": jnp.bool_}

KERNEL_BACKENDS = ("auto", "xla", "pallas", "interpret")


def resolve_backend(backend: str) -> str:
    """`auto` means Pallas kernels on GPU and XLA everywhere else."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return backend


def _kernel_impls(backend: str) -> dict[str, Callable]:
    """Overrides of the jnp references for the attention ops, by backend."""
    from runtime import kernels

    return kernels.lowerings(backend)


def state_names(graph: Graph) -> tuple[str, ...]:
    """Runtime inputs that the step also returns under the same name (KV caches / pools)."""
    outs = {name for name, _ in graph.outputs}
    return tuple(n.name for n in graph.runtime_inputs if n.name in outs)


def build_step(graph: Graph, backend: str = "xla", mesh_constraints: Callable | None = None):
    """Returns `step(params, state, inputs) -> (outputs, new_state)`, not yet jitted.

    params: weights by param name; state: the donated KV buffers; inputs: the other runtime
    inputs (tokens, positions, block tables...). `mesh_constraints(node, value)` may attach
    sharding constraints (tensor parallelism).
    """
    backend = resolve_backend(backend)
    overrides = _kernel_impls(backend)
    nodes = graph.nodes()
    leaves = graph.inputs
    state = set(state_names(graph))
    out_names = [(name, id(node)) for name, node in graph.outputs]
    plan = []
    for node in nodes:
        fn = overrides.get(node.op) or OPS[node.op].impl
        if fn is None:
            raise ValueError(f"op {node.op!r} has no implementation")
        # Sharding annotations steer mesh_constraints; the op's implementation never sees them.
        attrs = {k: v for k, v in node.attrs if k not in SHARDING_ATTRS}
        plan.append((id(node), fn, tuple(id(i) for i in node.inputs), attrs, node))

    def step(params: dict[str, Any], kv_state: dict[str, Any], inputs: dict[str, Any]):
        env: dict[int, Any] = {}
        for leaf in leaves:
            src = params if leaf.op == "param" else (kv_state if leaf.name in state else inputs)
            env[id(leaf)] = src[leaf.name]
        for nid, fn, ins, attrs, node in plan:
            val = fn(*(env[i] for i in ins), **attrs)
            if mesh_constraints is not None:
                val = mesh_constraints(node, val)
            env[nid] = val
        # Logits and hidden states leave the step in f32 whatever the model's dtype: the sampler,
        # logprobs and prompt logprobs work in f32 (a bf16 softmax over 49k entries loses digits).
        outs = {name: _f32(env[i]) for name, i in out_names if name not in state}
        new_state = {name: env[i] for name, i in out_names if name in state}
        return outs, new_state

    return step


def _f32(x):
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def jit_step(graph: Graph, backend: str = "xla", **jit_kwargs):
    """Jitted step; the KV state argument is donated so cache updates happen in place."""
    return jax.jit(build_step(graph, backend), donate_argnums=(1,), **jit_kwargs)


def to_device_params(graph: Graph, weights: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Puts the weights a graph's params name on device, in each param's declared dtype."""
    out = {}
    for p in graph.params:
        if p.name not in weights:
            raise KeyError(f"weights have no tensor for param %{p.name}")
        w = weights[p.name]
        if tuple(w.shape) != tuple(p.shape):
            raise ValueError(f"weight {p.name}: shape {tuple(w.shape)} != param shape {tuple(p.shape)}")
        out[p.name] = jnp.asarray(w, dtype=JNP_DTYPES[p.dtype])
    return out
