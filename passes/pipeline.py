"""The compiler pipeline: one explicit list of named passes, verified after each one."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from ir import Graph, verify
from passes.fuse_attention import fuse_attention
from passes.fuse_matmuls import fuse_matmuls
from passes.insert_paged_kv import insert_paged_kv
from passes.plan_memory import plan_memory, plan_memory_report


@dataclass(frozen=True)
class PipelineOptions:
    block_size: int = 16
    max_model_len: int = 2048
    buckets: tuple[tuple[int, int], ...] = ((16, 16),)
    device_memory_bytes: int = 4 << 30
    memory_utilization: float = 0.9
    reserve_bytes: int = 0
    memory_limit_bytes: int | None = None
    scan_layers: bool = False  # the executor scans the repeated layers (see runtime.worker.executor)
    # The backend widens half-precision weights to f32 for its products (XLA:CPU; see plan_memory).
    widen_half_weights: bool = False
    num_kv_blocks: int | None = None
    max_kv_blocks: int | None = None  # the most full-group KV blocks the configuration can use (None: no bound)
    kv_cache_memory_bytes: int | None = None  # the KV pools' bytes, fixed (None: what the budget leaves)
    quantization: str | None = None
    quantize_lm_head: bool | None = None  # EngineConfig.quantize_lm_head; None: the quantization's default
    matmul_precision: str = "float32"  # "bfloat16": wide steps multiply in bf16 (passes.bf16_matmuls)
    # (source weight, block format) for the weights whose GGUF blocks decode steps read
    # (passes.gguf_blocks); empty: none.
    block_formats: tuple[tuple[str, str], ...] = ()
    block_tiles: str | None = None  # ...repacked into tiles for every step, its products' activations "f32" or "q8"
    block_tiles_alone: bool = True  # the tiles replace their f32 weight (a kernel reads them: runtime.worker.executor)
    kv_dtype: str | None = None  # the KV pools' dtype (EngineConfig.kv_cache_dtype); None: the model's
    tensor_parallel_size: int = 1
    expert_parallel: bool = False  # MoE experts split among the tp devices, not each expert split
    # How the executor lowers paged_attention (see passes.plan_memory); sizes its workspace.
    paged_attention_lowering: str = "chunked"


def build_pipeline(opts: PipelineOptions) -> list[tuple[str, Callable[[Graph], Graph]]]:
    """The passes in order, bound to the options they need."""
    from passes.bf16_matmuls import bf16_matmuls
    from passes.gguf_blocks import gguf_blocks
    from ir.int8 import INT8_ACTIVATIONS
    from passes.quantize_int8 import quantize_int8
    from passes.shard import shard

    return [
        # Phase 1: pattern fusion on the textbook graph.
        ("fuse_attention", fuse_attention),
        # Phase 2: memory layout of the KV cache.
        ("insert_paged_kv", partial(insert_paged_kv, block_size=opts.block_size, kv_dtype=opts.kv_dtype)),
        # Phase 3: fewer, larger matmuls; optional weight compression.
        ("fuse_matmuls", partial(fuse_matmuls, formats=dict(opts.block_formats))),
        ("gguf_blocks", partial(gguf_blocks, formats=dict(opts.block_formats), tiles=opts.block_tiles,
                                        tiles_alone=opts.block_tiles_alone) if opts.block_formats else _identity),
        ("quantize_int8", partial(quantize_int8, activations=INT8_ACTIVATIONS if opts.quantization == "w8a8" else None,
                                  lm_head=opts.quantize_lm_head) if opts.quantization in ("int8", "w8a8") else _identity),
        ("bf16_matmuls", bf16_matmuls if opts.matmul_precision == "bfloat16" else _identity),
        # Phase 4: distribution over devices.
        ("shard", partial(shard, tp=opts.tensor_parallel_size, expert_parallel=opts.expert_parallel)),
        # Phase 5: memory planning (sizes the KV pool).
        ("plan_memory", partial(plan_memory, **_memory_options(opts))),
    ]


def _memory_options(opts: PipelineOptions) -> dict:
    return dict(buckets=list(opts.buckets), device_memory_bytes=opts.device_memory_bytes,
                memory_utilization=opts.memory_utilization, block_size=opts.block_size,
                max_model_len=opts.max_model_len, reserve_bytes=opts.reserve_bytes,
                tensor_parallel_size=opts.tensor_parallel_size, num_kv_blocks=opts.num_kv_blocks,
                paged_attention_lowering=opts.paged_attention_lowering,
                memory_limit_bytes=opts.memory_limit_bytes, scan_layers=opts.scan_layers,
                widen_half_weights=opts.widen_half_weights, max_kv_blocks=opts.max_kv_blocks,
                kv_cache_memory_bytes=opts.kv_cache_memory_bytes)


def memory_report(graph: Graph, opts: PipelineOptions):
    """The structured memory plan (dataclass + text table) of a pipeline's final graph."""
    return plan_memory_report(graph, **_memory_options(opts))


def _identity(graph: Graph) -> Graph:
    return graph


# The last pass, and the only one that reads opts.scan_layers: a caller that decides the layout
# from what the passes before it made (runtime.engine.plan.build_graph) stops before it and starts there.
MEMORY_PASS = "plan_memory"


def run_pipeline(graph: Graph, opts: PipelineOptions,
                 on_pass: Callable[[int, str, Graph], None] | None = None,
                 stop_after: str | None = None, stop_before: str | None = None,
                 start_at: str | None = None) -> Graph:
    """Runs every pass in order (from `start_at`, up to `stop_before` or through `stop_after`),
    verifying after each; `on_pass(i, name, graph)` sees each result."""
    verify(graph)
    started = start_at is None
    for i, (name, fn) in enumerate(build_pipeline(opts), 1):
        started = started or name == start_at
        if not started:
            continue
        if name == stop_before:
            break
        graph = verify(fn(graph))
        if on_pass is not None:
            on_pass(i, name, graph)
        if name == stop_after:
            break
    return graph
