"""Liveness over the scheduled node order -> peak activation bytes per bucket -> KV block budget."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from ir import DTYPE_BYTES, Graph, Node, bind_shape
from ir.attrs import ALL_GATHER, GGUF_BLOCKS, SHARDING, TP_AXIS
from ir.graph import freeze_attrs
from ir.kv_groups import is_pool, is_window_pool, kv_window, split_kv_blocks, window_blocks_for, window_blocks_per_seq
from ir.layers import find_layers
from ir.tiling import (PAGED_ATTENTION_LOWERINGS, XLA_CHUNK_BLOCKS, XLA_DENSE_MAX_SEQS, XLA_POOL_TILE,
                       XLA_ROW_GROUP, XLA_SEQ_CHUNK_BLOCKS, uses_new_kv)

# Elementwise ops XLA fuses into their consumer: a result with exactly one user that is itself
# fusible never gets a buffer of its own. A result with several users is materialized once
# (XLA only duplicates a producer into several fusions when it is nearly free). Views never
# allocate.
_FUSIBLE = {"add", "mul", "silu", "scale", "causal_mask", "rope", "slice", "reshape", "rms_norm"}
_VIEWS = {"reshape"}
# Outputs that alias a donated input buffer (KV pools and caches updated in place).
_IN_PLACE = {"kv_write", "kv_cache_update", "copy_blocks"}

F32 = 4
HALF = ("bf16", "f16")


def _ways(node: Node, env: dict[str, int]) -> int:
    """How many devices share a value: the size of mesh axis `tp` (bound in env like a dim) when
    the `shard` pass split it, 1 when it is replicated (a gathered output is replicated)."""
    split = TP_AXIS in (node.attr(SHARDING) or ()) and node.attr(ALL_GATHER) is None
    return env.get("tp", 1) if split else 1


def _nbytes(node: Node, env: dict[str, int]) -> int:
    """Bytes of a value on one device."""
    return math.prod(bind_shape(node.shape, env)) * DTYPE_BYTES[node.dtype] // _ways(node, env)


def _chunk_tokens(node: Node, env: dict[str, int], chunk_blocks: int) -> int:
    return min(chunk_blocks, env["M"]) * node.inputs[1].shape[1]


def _loop_state_bytes(node: Node, env: dict[str, int]) -> int:
    """The chunked loop's carry in f32: running max and denominator [T, hq], accumulator [T, hq, d]."""
    t, hq, d = bind_shape(node.inputs[0].shape, env)
    return t * hq * (d + 2) * F32 // _ways(node, env)


def _workspace_bytes(node: Node, env: dict[str, int], lowering: str = "chunked",
                     chunk_blocks: int = XLA_CHUNK_BLOCKS, scan_layers: bool = False,
                     widen_half_weights: bool = False) -> int:
    """Scratch an op's lowering needs beyond its inputs and its output, at its own peak."""
    if node.op == "matmul" and widen_half_weights and node.inputs[1].dtype in HALF:
        # XLA:CPU has no half-precision dot: the weight is widened to f32 where the product runs
        # (runtime.worker.kernels.matmul_half_cpu), one weight at a time.
        return _nbytes(node.inputs[1], env) * F32 // DTYPE_BYTES[node.inputs[1].dtype]
    if node.op == "moe_experts":
        return _moe_workspace_bytes(node, env)
    if _ways(node, env) > 1:  # heads split: each device runs the lowering on its share
        return _workspace_bytes(node, {**env, "tp": 1}, lowering, chunk_blocks, scan_layers) // _ways(node, env)
    if node.op == "paged_attention":
        q, kp = node.inputs[0], node.inputs[1]
        t, hq, d = bind_shape(q.shape, env)
        kvh = kp.shape[2]
        if lowering == "chunked":
            # One loop iteration, in program order: the chunk's K and V gathered and transposed
            # to f32 [T, kvh, chunk, d] (both live at the score matmul), and the scores
            # [T, hq, chunk]. The loop carry is counted by the caller (it lives longer).
            c = _chunk_tokens(node, env, chunk_blocks)
            s = env["S"]
            # Before the loop, prefill-shaped buckets score the step's tokens against each other:
            # scores and their exponentials [T, hq, T] in f32, and the mask [T, T]. The lowering
            # does it in query tiles below the diagonal (kernels.SELF_TILE), a bit over half of
            # that; the full square stays the bound, since independent tiles may run at once.
            own = 2 * t * hq * t * F32 + t * t if uses_new_kv(t, s) else 0
            if own:
                # The walk over earlier context goes per sequence (kernels._split_walk). Decode
                # rows: one row per sequence slot, XLA_ROW_GROUP rows at a time, each chunk's
                # per-row K/V gather and scores (unrolled, XLA fuses the gather into the
                # contractions; inside a scan it materializes it).
                # Continuations: a tile's scores and exponentials against one sequence's chunk of
                # XLA_SEQ_CHUNK_BLOCKS blocks, beside that chunk's K/V.
                g = min(s, XLA_ROW_GROUP)  # rows walked at once
                rows = 2 * g * hq * c * F32 if not scan_layers else 2 * g * c * kvh * d * F32 + g * hq * c * F32
                tq = min(t, XLA_POOL_TILE)
                c2 = min(XLA_SEQ_CHUNK_BLOCKS, env["M"]) * node.inputs[1].shape[1]
                seqs = 2 * tq * hq * c2 * F32 + 2 * c2 * kvh * d * F32
                return max(own, rows, seqs)
            if s <= XLA_DENSE_MAX_SEQS and t > s:
                # Dense few-sequence form: K/V gathered once per sequence [S, chunk, kvh, d],
                # scores over every (sequence, slot) [T, hq, S x chunk], plus their mask.
                return 2 * s * c * kvh * d * F32 + t * hq * s * c * F32 + t * s * c
            g = min(t, XLA_ROW_GROUP)  # the per-token walk goes XLA_ROW_GROUP rows at a time
            return 2 * g * c * kvh * d * F32 + g * hq * c * F32
        ctx = env["M"] * kp.shape[1]
        gathered = 2 * t * ctx * kvh * d * DTYPE_BYTES[kp.dtype]
        scores = 2 * t * hq * ctx * F32
        return gathered + scores
    if node.op == "attention":
        q, kc = node.inputs[0], node.inputs[1]
        t, hq, d = bind_shape(q.shape, env)
        ctx, kvh = bind_shape(kc.shape, env)[1:3]
        return 2 * t * ctx * kvh * d * F32 + 2 * t * hq * ctx * F32
    return 0


def _moe_workspace_bytes(node: Node, env: dict[str, int]) -> int:
    """The grouped lowering's scratch (runtime.worker.moe.moe_experts_grouped) on one device: its
    T x k rows of x sorted by expert, the gate, up and activated products [T x k, I / tp] in f32, and
    the down product and its rows put back in order [T x k, H] in f32; the grouped products'
    own; plus, for int8 experts, the layer's stacks widened to the activations' dtype."""
    x, ids, wg = node.inputs[0], node.inputs[1], node.inputs[3]
    t, h = bind_shape(x.shape, env)
    rows = t * ids.shape[1]
    inter = wg.shape[2] // (env.get("tp", 1) if (wg.attr(SHARDING) or (None,) * 3)[2] == TP_AXIS else 1)
    scratch = rows * (h * DTYPE_BYTES[x.dtype] + 3 * inter * F32 + 2 * h * F32)
    # The grouped products (kernels.grouped_matmul): on XLA:CPU a tile loop whose carries hold
    # [T x k + tile, N] per product and whose tiles take their expert's matrix as a copy.
    scratch += rows * (2 * inter + h) * F32 + 3 * h * inter * F32
    if wg.dtype == "i8":  # measured: two of the three widened stacks live at once
        scratch += 2 * max(_nbytes(w, env) for w in node.inputs[3:6]) * DTYPE_BYTES[x.dtype]
    return scratch


def activation_peak_bytes(graph: Graph, env: dict[str, int], lowering: str = "chunked",
                          chunk_blocks: int = XLA_CHUNK_BLOCKS, scan_layers: bool = False,
                          widen_half_weights: bool = False) -> int:
    """Peak bytes of a step's temporaries (what XLA reports as temp_size), for one bucket.

    Walks the nodes in the executor's order with a liveness analysis: a value is allocated when
    its node runs and freed after the last op that reads it. Like XLA's buffer assignment, it
    leaves out the step's arguments and its outputs (separate buffers; see `step_io_bytes`),
    views, values updated in place in donated buffers, and elementwise results fused into their
    only consumer. Each op adds its lowering's workspace while it runs. The chunked attention loop's
    initial carry is a copy of a constant with no inputs, and XLA's scheduler places those
    copies at the top of the program, so every layer's carry is live from the start of the
    step until its loop runs.

    With `scan_layers` (the executor runs the repeated layers as one lax.scan, see ir.layers),
    XLA holds one layer at a time: each layer's loop carry is live from the top of its layer
    body, and the layer's weights are sliced out of their stacks into temporaries for the
    duration of the body.

    With `widen_half_weights` (XLA:CPU, which has no bf16 or f16 dot), a product by a half-precision
    weight holds an f32 copy of that weight while it runs.
    """
    if lowering not in PAGED_ATTENTION_LOWERINGS:
        raise ValueError(f"paged attention lowering must be one of {PAGED_ATTENTION_LOWERINGS}, "
                         f"got {lowering!r}")
    nodes = graph.nodes()
    index = {id(n): i for i, n in enumerate(nodes)}
    users: dict[int, list[Node]] = {}
    for n in nodes:
        for x in n.inputs:
            users.setdefault(id(x), []).append(n)
    outputs = {id(n) for _, n in graph.outputs}

    def fused(n: Node) -> bool:
        us = users.get(id(n), ())
        return n.op in _FUSIBLE and len(us) == 1 and us[0].op in _FUSIBLE and id(n) not in outputs

    # A view or a fused result has no buffer of its own: its inputs are read when its data is
    # (by the fusion's root, or by the view's readers). So a value lives until the last op that
    # reads it through such chains, found walking the order backwards.
    through = {id(n): n.op in _VIEWS or fused(n) for n in nodes}
    last_read: dict[int, int] = {}
    for i in range(len(nodes) - 1, -1, -1):
        n = nodes[i]
        t = len(nodes) if id(n) in outputs else i
        for u in users.get(id(n), ()):
            t = max(t, last_read[id(u)] if through[id(u)] else index[id(u)])
        last_read[id(n)] = t

    hoisted = {}
    if lowering == "chunked":
        hoisted = {id(n): _loop_state_bytes(n, env) for n in nodes if n.op == "paged_attention"}
    layers = find_layers(graph) if scan_layers else None
    allocs: dict[int, int] = {}  # node index -> bytes that become live when it runs
    frees: dict[int, int] = {}
    if layers is None:
        live = sum(hoisted.values())
    else:
        live = 0
        for layer, leaves in zip(layers.layer_nodes, layers.leaves):
            first, last = index[id(layer[0])], index[id(layer[-1])]
            # A layer's weights as the scan slices them; GGUF blocks are never sliced: the cpp
            # kernels read them in the stack, and other backends do not read them at all.
            weights = sum(_nbytes(x, env) for x in leaves.values() if x.op == "param" and not x.attr(GGUF_BLOCKS))
            allocs[first] = weights + sum(hoisted.get(id(n), 0) for n in layer)
            frees[last] = frees.get(last, 0) + weights
    peak = live
    for i, n in enumerate(nodes):
        live += allocs.pop(i, 0)
        # Outputs get their own buffers and in-place results alias donated ones: not temporaries.
        owns = not (through[id(n)] or n.op in _IN_PLACE or id(n) in outputs)
        size = _nbytes(n, env) if owns else 0
        peak = max(peak, live + size + _workspace_bytes(n, env, lowering, chunk_blocks, scan_layers,
                                                         widen_half_weights))
        live += size
        frees[last_read[id(n)]] = frees.get(last_read[id(n)], 0) + size
        live -= frees.pop(i, 0) + hoisted.get(id(n), 0)
    return peak


# The runtime samples inside the step executable, after the model's temporaries are dead. XLA's
# temp for the sampler (runtime.worker.sampler.sample_rows) is 6 f32 [rows, vocab] arrays, measured
# at 4, 16 and 64 rows of a 49,152 vocabulary (6.8, 6.2 and 6.05): the f32 logits, the masked and
# biased logits, the penalty counts, and the draw's scaled logits, bit-pattern keys and
# probabilities (both lax.cond branches get buffers).
SAMPLER_WORKSPACE_ARRAYS = 6


def sampler_workspace_bytes(graph: Graph, env: dict[str, int]) -> int:
    """Peak temporaries of the sampler fused into the step, for one bucket. Under tensor
    parallelism the vocab-split logits are gathered whole onto every device first, in the model's
    dtype: one more array in f32 (SmolLM2 at tp=2, 64 rows: 84.6 MiB measured, 7.05 arrays); in
    bf16 XLA measured none more (72.6 MiB), so the half array counted errs high."""
    logits = dict(graph.outputs).get("logits")
    if logits is None:  # a graph that samples nothing (hand-built in tests)
        return 0
    rows, vocab = bind_shape(logits.shape, env)
    gathered = rows * vocab * DTYPE_BYTES[logits.dtype] if env.get("tp", 1) > 1 else 0
    return SAMPLER_WORKSPACE_ARRAYS * rows * vocab * F32 + gathered


def copy_blocks_bytes(graph: Graph, max_seqs: int) -> int:
    """Temporaries of the copy-on-write executable (runtime.worker.model_runner._copy_blocks): the
    source blocks of up to `max_seqs` pairs (per KV cache group) gathered from every layer's pools
    before they are written (90.0 MiB measured for SmolLM2's 64 pairs in f32: 64 x 1.41 MiB)."""
    return max_seqs * (kv_bytes_per_block(graph) + kv_bytes_per_block(graph, window=True))


def step_io_bytes(graph: Graph, env: dict[str, int]) -> int:
    """A step's argument and output buffers other than the weights and the KV state. Floating
    outputs leave the step in f32 whatever the model's dtype (runtime.worker.executor)."""
    state = {n.name for n in graph.runtime_inputs} & {name for name, _ in graph.outputs}
    ins = sum(_nbytes(x, env) for x in graph.runtime_inputs if x.name not in state)
    outs = sum(_nbytes(n, env) * (F32 // DTYPE_BYTES[n.dtype] if n.dtype in HALF else 1)
               for name, n in graph.outputs if name not in state)
    return ins + outs


# The sampler's arguments and results per row (runtime.worker.sampler, fused into the step; a test
# holds these to its input_specs): the token history [max_model_len] and the grammar bitmask
# [vocab / 32] in i32, SAMPLER_BIAS_SLOTS logit-bias ids and values, SAMPLER_ROW_SCALARS 4-byte
# settings, and the sampled token, its logprob and the top SAMPLER_TOP_LOGPROBS ids and logprobs.
SAMPLER_BIAS_SLOTS = 300
SAMPLER_ROW_SCALARS = 10
SAMPLER_TOP_LOGPROBS = 20


def sampler_io_bytes(rows: int, vocab: int, max_model_len: int) -> int:
    """The sampler's argument and result buffers for a bucket of `rows` rows."""
    per_row = (max_model_len + -(-vocab // 32) + 2 * SAMPLER_BIAS_SLOTS + SAMPLER_ROW_SCALARS
               + 2 + 2 * SAMPLER_TOP_LOGPROBS)
    return rows * per_row * 4


def weight_bytes(graph: Graph) -> int:
    """Weight bytes on one device: a weight the `shard` pass split counts 1/tp."""
    env = {"tp": graph.meta_value("tp", 1)}
    return sum(math.prod(p.shape) * DTYPE_BYTES[p.dtype] // _ways(p, env) for p in graph.params)


def kv_bytes_per_block(graph: Graph, window: bool = False) -> int:
    """Bytes of one block of the full group's pools (`window`: of the window group's; ir.kv_groups)."""
    pools = [x for x in graph.runtime_inputs if is_pool(x) and is_window_pool(x) == window]
    env = {"tp": graph.meta_value("tp", 1)}
    return sum(math.prod(p.shape[1:]) * DTYPE_BYTES[p.dtype] // _ways(p, env) for p in pools)


@dataclass(frozen=True)
class BucketMemory:
    """One bucket: predicted temporaries (comparable to XLA's temp_size), XLA's own number once
    compiled, and the step's argument/output buffers (tokens, block tables, logits...)."""

    num_tokens: int
    num_seqs: int
    activation_bytes: int
    xla_temp_bytes: int | None = None
    io_bytes: int = 0
    xla_io_bytes: int | None = None  # XLA's argument + output bytes, less weights and KV pools

    @property
    def total_bytes(self) -> int:
        return self.activation_bytes + self.io_bytes

    @property
    def measured_bytes(self) -> int | None:
        """XLA's temporaries plus the step's own buffers (XLA's, else the predicted ones)."""
        if self.xla_temp_bytes is None:
            return None
        return self.xla_temp_bytes + (self.io_bytes if self.xla_io_bytes is None else self.xla_io_bytes)


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
    # What the allocator can still hand out (JAX's preallocation fraction minus what is held),
    # when it is less than utilization x device memory. None: no separate limit (CPU).
    memory_limit_bytes: int | None = None
    kv_dtype: str | None = None  # the KV pools' IR dtype (kv_cache_dtype); None in plans saved before it
    # Set at start-up, once XLA has compiled every executable (runtime.worker.model_runner): the
    # largest of their temporaries plus their own buffers, and the KV block count the prediction
    # gave before the pool was sized from that measurement.
    measured_peak_bytes: int | None = None
    planned_kv_blocks: int | None = None
    # The window group (ir.kv_groups), beside the full group above: its window, bytes per block and
    # block count (the null block included); the largest step's tokens bound a prefill chunk's
    # blocks in it. Zero and None without one.
    kv_window: int | None = None
    window_kv_bytes_per_block: int = 0
    num_window_kv_blocks: int = 0
    max_step_tokens: int = 0
    # The most full-group blocks the engine's configuration can use (on CPU: EngineConfig.kv_blocks_used);
    # the pool takes no more even where the budget leaves room. None: no such bound (GPU).
    max_kv_blocks: int | None = None
    # The KV pools' bytes, fixed by the user (kv_cache_memory_bytes, VLLM_CPU_KVCACHE_SPACE); None: sized here.
    kv_cache_memory_bytes: int | None = None

    @property
    def budget_bytes(self) -> int:
        """What weights, activations, the reserve and the KV cache may use together."""
        budget = int(self.device_memory_bytes * self.memory_utilization)
        return budget if self.memory_limit_bytes is None else min(budget, self.memory_limit_bytes)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_bytes_per_block + self.num_window_kv_blocks * self.window_kv_bytes_per_block

    def _groups(self) -> dict:
        return dict(window=self.kv_window, block_size=self.block_size, max_model_len=self.max_model_len,
                    max_num_batched_tokens=self.max_step_tokens)

    def kv_blocks_that_fit(self, peak_bytes: int) -> tuple[int, int]:
        """(full, window) KV blocks left by the budget after the weights, an activation peak and the
        reserve, split between the groups as sequences at max_model_len use them (ir.kv_groups),
        and no more than the configuration can use (max_kv_blocks)."""
        free = self.budget_bytes - self.weight_bytes - peak_bytes - self.reserve_bytes
        full, window = self.kv_blocks_in(free)
        if self.max_kv_blocks is not None and full > self.max_kv_blocks:
            return self.max_kv_blocks, self.window_blocks_for(self.max_kv_blocks)
        return full, window

    def kv_blocks_in(self, kv_bytes: int) -> tuple[int, int]:
        """(full, window) KV blocks that `kv_bytes` hold, split as kv_blocks_that_fit splits them."""
        return split_kv_blocks(kv_bytes, full_bytes_per_block=self.kv_bytes_per_block,
                               window_bytes_per_block=self.window_kv_bytes_per_block, **self._groups())

    def blocks_that_fit(self, peak_bytes: int) -> int:
        """Full-group KV blocks that fit beside an activation peak (kv_blocks_that_fit)."""
        return self.kv_blocks_that_fit(peak_bytes)[0]

    def window_blocks_for(self, num_kv_blocks: int) -> int:
        """The window group's blocks beside `num_kv_blocks` full ones (a count the user fixed)."""
        return window_blocks_for(num_kv_blocks, **self._groups())

    def with_blocks(self, num_kv_blocks: int, num_window_kv_blocks: int, **changes) -> "MemoryPlan":
        """This plan with these block counts, and the sequences at max_model_len they hold."""
        seqs = num_kv_blocks // -(-self.max_model_len // self.block_size)
        if self.kv_window is not None:
            per_seq = window_blocks_per_seq(self.kv_window, self.block_size, self.max_model_len)
            seqs = min(seqs, max(num_window_kv_blocks - 1 - -(-self.max_step_tokens // self.block_size), 0) // per_seq)
        return replace(self, num_kv_blocks=num_kv_blocks, num_window_kv_blocks=num_window_kv_blocks,
                       max_concurrent_seqs=seqs, **changes)

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
        ]
        if self.memory_limit_bytes is not None:
            binds = self.memory_limit_bytes < self.device_memory_bytes * self.memory_utilization
            lines.append(f"  allocator limit        {mib(self.memory_limit_bytes)}{'  (binds)' if binds else ''}")
        lines.append(f"  - weights              {mib(self.weight_bytes)}")
        if self.measured_peak_bytes is None:
            lines.append(f"  - peak activations     {mib(self.peak_activation_bytes)}  (predicted)")
        else:
            lines.append(f"  - peak activations     {mib(self.measured_peak_bytes)}  (measured by XLA;"
                         f" predicted {self.peak_activation_bytes / 2**20:.1f} MiB)")
        planned = ""
        if self.planned_kv_blocks is not None and self.planned_kv_blocks != self.num_kv_blocks:
            planned = f"; the prediction gave {self.planned_kv_blocks}"
        lines += [
            f"  - reserve              {mib(self.reserve_bytes)}",
            f"  = KV cache             {mib(self.kv_cache_bytes)}"
            f"  ({self.num_kv_blocks} blocks x {self.block_size} tokens,"
            f" {self.kv_bytes_per_block / self.block_size / 1024:.1f} KiB/token"
            f"{', ' + self.kv_dtype if self.kv_dtype else ''}{planned})",
        ]
        if self.kv_window is not None:
            lines[-1] = (f"  = KV cache             {mib(self.kv_cache_bytes)}  full layers "
                         f"{self.num_kv_blocks} blocks x {self.block_size} tokens "
                         f"({self.kv_bytes_per_block / self.block_size / 1024:.1f} KiB/token){planned}; "
                         f"window-{self.kv_window} layers {self.num_window_kv_blocks} blocks "
                         f"({self.window_kv_bytes_per_block / self.block_size / 1024:.1f} KiB/token)"
                         f"{', ' + self.kv_dtype if self.kv_dtype else ''}")
        if self.kv_cache_memory_bytes is not None and self.num_kv_blocks == self.kv_blocks_in(self.kv_cache_memory_bytes)[0]:
            lines.append(f"    the KV cache's size fixed at {mib(self.kv_cache_memory_bytes).strip()}")
        elif self.max_kv_blocks is not None and self.num_kv_blocks == self.max_kv_blocks:
            lines.append(f"    what max_num_seqs x max_model_len use, and room for the prefix cache "
                         f"({self.max_kv_blocks} blocks); the budget leaves room for more")
        lines.append(f"  max concurrent seqs at max_model_len={self.max_model_len}: {self.max_concurrent_seqs}")
        if self.buckets:
            lines.append("  peak activations = max over buckets of predicted temp + step I/O, and over block copies")
            lines.append("  bucket (tokens x seqs)  predicted temp        XLA temp   pred/XLA        step I/O"
                         "    XLA step I/O")
            for b in self.buckets:
                xla, ratio, xio = "             -", "       -", "             -"
                if b.xla_temp_bytes is not None:
                    xla = mib(b.xla_temp_bytes)
                    ratio = f"{b.activation_bytes / b.xla_temp_bytes:8.2f}" if b.xla_temp_bytes else "     inf"
                if b.xla_io_bytes is not None:
                    xio = mib(b.xla_io_bytes)
                lines.append(f"  {b.num_tokens:>6} x {b.num_seqs:<6}     {mib(b.activation_bytes)}  {xla}"
                             f"   {ratio}  {mib(b.io_bytes)}  {xio}")
        return "\n".join(lines)


def plan_memory_report(graph: Graph, *, buckets: list[tuple[int, int]], device_memory_bytes: int,
                       memory_utilization: float, block_size: int, max_model_len: int,
                       reserve_bytes: int = 0, tensor_parallel_size: int = 1,
                       num_kv_blocks: int | None = None,
                       paged_attention_lowering: str = "chunked",
                       memory_limit_bytes: int | None = None, scan_layers: bool = False,
                       widen_half_weights: bool = False, max_kv_blocks: int | None = None,
                       kv_cache_memory_bytes: int | None = None) -> MemoryPlan:
    """Sizes the KV pool from what is left after weights and the worst bucket's activations.

    num_kv_blocks = floor((min(memory_utilization x device memory, allocator limit) - weights
    - peak activations - reserve) / KV bytes per block), where peak activations is the largest bucket's predicted
    temporaries plus its argument and output buffers, and at most `max_kv_blocks` (what the
    configuration can use; None: no bound). `kv_cache_memory_bytes` fixes the KV bytes instead, and
    `num_kv_blocks` the full group's count (it wins). With a window group (ir.kv_groups) the bytes
    are split between the groups in the proportion sequences at max_model_len use them. With tensor parallelism every byte figure
    is per device: a weight, KV pool or activation the `shard` pass split (its `sharding` attr)
    counts 1/tp, a replicated one counts fully.
    """
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    max_blocks = -(-max_model_len // block_size)
    per_bucket = []
    logits = dict(graph.outputs).get("logits")
    vocab = logits.shape[-1] if logits is not None else 0
    for t, s in buckets:
        env = {"T": t, "S": s, "R": s, "M": max_blocks, "B": 1, "BW": 1, "tp": graph.meta_value("tp", 1)}
        act = max(activation_peak_bytes(graph, env, paged_attention_lowering, scan_layers=scan_layers,
                                        widen_half_weights=widen_half_weights),
                  sampler_workspace_bytes(graph, env))
        io = step_io_bytes(graph, env) + (sampler_io_bytes(s, vocab, max_model_len) if vocab else 0)
        per_bucket.append(BucketMemory(t, s, act, None, io))
    peak = max((b.total_bytes for b in per_bucket), default=0)
    if any(is_pool(x) for x in graph.runtime_inputs):
        peak = max(peak, copy_blocks_bytes(graph, max((s for _, s in buckets), default=0)))
    w = weight_bytes(graph)
    per_block = kv_bytes_per_block(graph)
    kv_dtypes = sorted({x.dtype for x in graph.runtime_inputs if is_pool(x)})
    plan = MemoryPlan(device_memory_bytes, memory_utilization, reserve_bytes, w, peak, per_block,
                      block_size, 0, max_model_len, 0, tuple(per_bucket), tensor_parallel_size,
                      memory_limit_bytes, ",".join(kv_dtypes) or None, kv_window=kv_window(graph),
                      window_kv_bytes_per_block=kv_bytes_per_block(graph, window=True),
                      max_step_tokens=max((t for t, _ in buckets), default=0), max_kv_blocks=max_kv_blocks,
                      kv_cache_memory_bytes=kv_cache_memory_bytes)
    blocks, window_blocks = plan.kv_blocks_that_fit(peak)
    if num_kv_blocks is not None:
        blocks, window_blocks = num_kv_blocks, plan.window_blocks_for(num_kv_blocks)
    elif kv_cache_memory_bytes is not None:
        blocks, window_blocks = plan.kv_blocks_in(kv_cache_memory_bytes)
    return plan.with_blocks(blocks, window_blocks)


def plan_memory(graph: Graph, **options) -> Graph:
    """Records the memory plan's KV block count in graph meta (binding the B dim)."""
    if not any(is_pool(x) for x in graph.runtime_inputs):
        return graph
    plan = plan_memory_report(graph, **options)
    meta = dict(graph.meta) | {"num_kv_blocks": plan.num_kv_blocks}
    if plan.kv_window is not None:
        meta["num_window_kv_blocks"] = plan.num_window_kv_blocks
    return Graph(graph.inputs, graph.outputs, freeze_attrs(meta))
