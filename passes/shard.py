"""Tensor parallelism: annotates weights and activations with PartitionSpecs over mesh axis `tp`."""

from __future__ import annotations

from ir import Graph


def shard(graph: Graph, tp: int = 1) -> Graph:
    """Megatron split over `tp` devices; a no-op at tp=1."""
    if tp == 1:
        return graph
    raise NotImplementedError("tensor parallelism lands with the scale-out issue")
