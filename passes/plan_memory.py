"""Liveness over the scheduled node order -> peak activation bytes per bucket -> KV block budget."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ir import DTYPE_BYTES, Graph, Node, bind_shape
from ir.graph import freeze_attrs

# Ops XLA folds into a neighbouring fusion, so their result is never a buffer of its own when
# their only consumer is also fusible. Views (reshape) never allocate.
_FUSIBLE = {"add", "mul", "silu", "scale", "causal_mask", "rope", "slice", "reshape", "rms_norm"}
_VIEWS = {"reshape"}
# Outputs that alias a donated input buffer (KV pools updated in place).
_IN_PLACE = {"kv_write", "kv_cache_update", "copy_blocks"}


def _ways(node: Node, env: dict[str, int]) -> int:
    """How many devices share a value: the size of mesh axis `tp` (bound in env like a dim) when
    the `shard` pass split it, 1 when it is replicated (a gathered output is replicated)."""
    split = "tp" in (node.attr("sharding") or ()) and node.attr("all_gather") is None
    return env.get("tp", 1) if split else 1


def _nbytes(node: Node, env: dict[str, int]) -> int:
    """Bytes of a value on one device."""
    return math.prod(bind_shape(node.shape, env)) * DTYPE_BYTES[node.dtype] // _ways(node, env)


def _workspace_bytes(node: Node, env: dict[str, int]) -> int:
    """Scratch an op's lowering needs beyond its output (the XLA paged gather)."""
    if _ways(node, env) > 1:  # heads split: each device runs the lowering on its share
        return _workspace_bytes(node, {**env, "tp": 1}) // _ways(node, env)
    if node.op == "paged_attention":
        q, kp = node.inputs[0], node.inputs[1]
        t, hq, d = bind_shape(q.shape, env)
        ctx = env["M"] * kp.shape[1]
        kvh = kp.shape[2]
        gathered = 2 * t * ctx * kvh * d * DTYPE_BYTES[kp.dtype]
        scores = 2 * t * hq * ctx * 4
        return gathered + scores
    if node.op == "attention":
        q, kc = node.inputs[0], node.inputs[1]
        t, hq, d = bind_shape(q.shape, env)
        ctx, kvh = bind_shape(kc.shape, env)[1:3]
        return 2 * t * ctx * kvh * d * 4 + 2 * t * hq * ctx * 4
    return 0


def activation_peak_bytes(graph: Graph, env: dict[str, int]) -> int:
    """Peak bytes of live intermediates, walking the nodes in the executor's order."""
    nodes = graph.nodes()
    index = {id(n): i for i, n in enumerate(nodes)}
    last_use: dict[int, int] = {}
    users: dict[int, list[Node]] = {}
    for i, n in enumerate(nodes):
        for x in n.inputs:
            last_use[id(x)] = i
            users.setdefault(id(x), []).append(n)
    end = len(nodes)
    for _, out in graph.outputs:
        last_use[id(out)] = end
    runtime_bytes = sum(_nbytes(x, env) for x in graph.runtime_inputs if "_pool" not in x.name
                        and "_cache" not in x.name)
    frees: dict[int, int] = {}
    live, peak = runtime_bytes, runtime_bytes
    for i, n in enumerate(nodes):
        us = users.get(id(n), [])
        fused = n.op in _FUSIBLE and us and all(u.op in _FUSIBLE for u in us) and last_use[id(n)] != end
        size = 0 if (n.op in _VIEWS or n.op in _IN_PLACE or fused) else _nbytes(n, env)
        peak = max(peak, live + size + _workspace_bytes(n, env))
        live += size
        frees[last_use.get(id(n), i)] = frees.get(last_use.get(id(n), i), 0) + size
        live -= frees.pop(i, 0)
    return peak


def weight_bytes(graph: Graph) -> int:
    """Weight bytes on one device: a weight the `shard` pass split counts 1/tp."""
    env = {"tp": graph.meta_value("tp", 1)}
    return sum(math.prod(p.shape) * DTYPE_BYTES[p.dtype] // _ways(p, env) for p in graph.params)


def kv_bytes_per_block(graph: Graph) -> int:
    pools = [x for x in graph.runtime_inputs if "_pool." in x.name]
    env = {"tp": graph.meta_value("tp", 1)}
    return sum(math.prod(p.shape[1:]) * DTYPE_BYTES[p.dtype] // _ways(p, env) for p in pools)


@dataclass(frozen=True)
class BucketMemory:
    num_tokens: int
    num_seqs: int
    activation_bytes: int
    xla_temp_bytes: int | None = None


@dataclass(frozen=True)
class MemoryPlan:
    device_memory_bytes: int
    memory_utilization: float
    reserve_bytes: int
    weight_bytes: int
    peak_activation_bytes: int
    kv_bytes_per_block: int
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    max_concurrent_seqs: int
    buckets: tuple[BucketMemory, ...] = field(default=())
    tensor_parallel_size: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryPlan":
        d = dict(d)
        d["buckets"] = tuple(BucketMemory(**b) for b in d.get("buckets", ()))
        return cls(**d)

    def table(self) -> str:
        """A readable report, like MLC-LLM's memory usage summary."""
        mib = lambda b: f"{b / 2**20:10.1f} MiB"
        tp = self.tensor_parallel_size
        per = " per device" if tp > 1 else ""
        lines = [
            f"memory plan{per} (tensor_parallel_size={tp})" if tp > 1 else "memory plan",
            f"  device memory          {mib(self.device_memory_bytes)}",
            f"  x utilization {self.memory_utilization:<8} {mib(self.device_memory_bytes * self.memory_utilization)}",
            f"  - weights              {mib(self.weight_bytes)}",
            f"  - peak activations     {mib(self.peak_activation_bytes)}",
            f"  - reserve              {mib(self.reserve_bytes)}",
            f"  = KV cache             {mib(self.num_kv_blocks * self.kv_bytes_per_block)}"
            f"  ({self.num_kv_blocks} blocks x {self.block_size} tokens,"
            f" {self.kv_bytes_per_block / self.block_size / 1024:.1f} KiB/token)",
            f"  max concurrent seqs at max_model_len={self.max_model_len}: {self.max_concurrent_seqs}",
        ]
        if self.buckets:
            lines.append("  bucket (tokens x seqs)   predicted act.   XLA temp")
            for b in self.buckets:
                xla = mib(b.xla_temp_bytes) if b.xla_temp_bytes is not None else "         -"
                lines.append(f"  {b.num_tokens:>6} x {b.num_seqs:<6}       {mib(b.activation_bytes)} {xla}")
        return "\n".join(lines)


def plan_memory_report(graph: Graph, *, buckets: list[tuple[int, int]], device_memory_bytes: int,
                       memory_utilization: float, block_size: int, max_model_len: int,
                       reserve_bytes: int = 0, tensor_parallel_size: int = 1,
                       num_kv_blocks: int | None = None) -> MemoryPlan:
    """Sizes the KV pool from what is left after weights and the worst bucket's activations.

    With tensor parallelism every byte figure is per device: a weight, KV pool or activation
    the `shard` pass split (its `sharding` attr) counts 1/tp, a replicated one counts fully.
    """
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    max_blocks = -(-max_model_len // block_size)
    per_bucket = []
    for t, s in buckets:
        env = {"T": t, "S": s, "R": s, "M": max_blocks, "B": 1, "tp": graph.meta_value("tp", 1)}
        per_bucket.append(BucketMemory(t, s, activation_bytes(graph, env, tensor_parallel_size)))
    peak = max((b.activation_bytes for b in per_bucket), default=0)
    w = weight_bytes(graph)
    per_block = kv_bytes_per_block(graph)
    budget = int(device_memory_bytes * memory_utilization) - w - peak - reserve_bytes
    blocks = max(budget // per_block, 0) if per_block else 0
    if num_kv_blocks is not None:
        blocks = num_kv_blocks
    return MemoryPlan(device_memory_bytes, memory_utilization, reserve_bytes, w, peak, per_block,
                      block_size, blocks, max_model_len, blocks // max_blocks, tuple(per_bucket),
                      tensor_parallel_size)


def activation_bytes(graph: Graph, env: dict[str, int], tp: int = 1) -> int:
    return activation_peak_bytes(graph, env)  # per device: see _ways


def plan_memory(graph: Graph, **options) -> Graph:
    """Records the memory plan's KV block count in graph meta (binding the B dim)."""
    if not any("_pool." in x.name for x in graph.runtime_inputs):
        return graph
    plan = plan_memory_report(graph, **options)
    meta = dict(graph.meta) | {"num_kv_blocks": plan.num_kv_blocks}
    return Graph(graph.inputs, graph.outputs, freeze_attrs(meta))
