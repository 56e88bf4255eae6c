"""The device mesh for tensor parallelism: the IR's `sharding` specs as `NamedSharding`s.

The `shard` pass writes a PartitionSpec on every weight, KV pool and activation. This module
builds a 1-D `jax.sharding.Mesh` over `tp` devices and gives the ModelRunner three hooks:

    put_param(node, array)   places a weight, each device receiving only its own shard
    put_state(node, array)   places a KV pool (split by kv head)
    constrain(node, value)   `with_sharding_constraint` on every value inside the jitted step

The step is jitted once per bucket as on one device; JAX's SPMD partitioner derives the
per-device program and inserts the collectives (all-reduce after the row-split matmuls and
the vocab-split embedding lookup, all-gather of the logits). No communication is written here.

Multi-host: under `jax.distributed.initialize()`, `jax.devices()` lists every process's
devices, the mesh spans hosts, and `make_array_from_callback` places on each process only the
shards its local devices own. Every process runs the same engine loop on the same inputs.
"""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ir import Graph, Node
from ir.attrs import ALL_GATHER, SHARDING, TP_AXIS as AXIS

log = logging.getLogger("runtime.worker.sharding")


def make_mesh(tp: int, devices=None) -> Mesh:
    """A 1-D mesh named `tp` over the first `tp` devices (all processes' devices, multi-host)."""
    devices = list(devices if devices is not None else jax.devices())
    if tp > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tp} needs {tp} devices but JAX sees {len(devices)} "
            f"({devices[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={tp} "
            f"before JAX starts, on GPU/TPU lower tensor_parallel_size")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def partition_spec(spec) -> PartitionSpec:
    return PartitionSpec(*(spec or ()))


class TensorParallelMesh:
    """Places a plan's weights and KV state on a `tp` mesh and constrains the step's values."""

    def __init__(self, tp: int, devices=None):
        self.tp = tp
        self.mesh = make_mesh(tp, devices)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self._cache: dict[tuple, NamedSharding] = {}

    @classmethod
    def for_graph(cls, graph: Graph, tp: int, devices=None) -> "TensorParallelMesh":
        if graph.meta_value("tp", 1) != tp:
            raise ValueError(f"the plan's graph was sharded for tp={graph.meta_value('tp', 1)}, "
                             f"not tensor_parallel_size={tp}; recompile the plan")
        for note in graph.meta_value("tp_notes", ()) or ():
            log.warning("tensor parallel: %s", note)
        return cls(tp, devices)

    def sharding(self, spec) -> NamedSharding:
        key = tuple(spec or ())
        if key not in self._cache:
            self._cache[key] = NamedSharding(self.mesh, partition_spec(key))
        return self._cache[key]

    def node_sharding(self, node: Node) -> NamedSharding:
        return self.sharding(node.attr(SHARDING))

    def _put(self, node: Node, x, dtype=None):
        sharding = self.node_sharding(node)
        if isinstance(x, jax.Array):
            return jax.device_put(x.astype(dtype) if dtype is not None else x, sharding)
        host = np.asarray(x)
        if dtype is not None:
            host = host.astype(dtype, copy=False)
        # Each device (on every host) copies in only the slice it owns: no full weight on any device.
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    def put_param(self, node: Node, x, dtype=None, stacked: bool = False):
        """A weight; `stacked`: a [num_layers, ...] stack of this node's per-layer weights."""
        if stacked:
            sharding = self.sharding((None,) + tuple(node.attr(SHARDING) or (None,) * len(node.shape)))
            host = np.asarray(x).astype(dtype, copy=False) if dtype is not None else np.asarray(x)
            return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
        return self._put(node, x, dtype)

    def put_state(self, node: Node, x, dtype=None):
        return self._put(node, x, dtype)

    def constrain(self, node: Node, value):
        spec = node.attr(SHARDING)
        if spec is None:
            return value
        value = jax.lax.with_sharding_constraint(value, self.sharding(spec))
        if node.attr(ALL_GATHER) is not None:
            # Computed split (e.g. vocab-parallel logits), then gathered: the step's outputs are
            # replicated so the sampler sees whole rows.
            value = jax.lax.with_sharding_constraint(value, self.replicated)
        return value

    def per_device(self, node: Node, fn):
        """`fn` (taking one device's shards and `axis`, and all-reducing its own result) run in
        shard_map over the inputs' specs: the step calls it as the op's implementation, and its
        output is replicated. For ops whose partial result XLA's partitioner would reduce too early
        or could not split at all (moe_experts: the experts' rows before their per-token sum; the
        experts split among the devices)."""
        in_specs = tuple(partition_spec(i.attr(SHARDING)) for i in node.inputs)

        def run(*args, **attrs):
            body = functools.partial(fn, axis=AXIS, **attrs)
            return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=PartitionSpec(),
                                 check_vma=False)(*args)

        return run

    def local_copy(self, value):
        """A replicated step output as a single-device array on this process's first device.

        The host reads step outputs from one device; a replicated value already has a full copy
        there, so this moves nothing.
        """
        device = jax.local_devices()[0]
        for shard in value.addressable_shards:
            if shard.device == device and shard.data.shape == value.shape:
                return shard.data
        return jax.device_put(value, device)

    def describe(self) -> str:
        return f"mesh tp={self.tp} over {[str(d) for d in self.mesh.devices.flat]}"
