"""The graph half of a plan: lower a model and run the passes for an engine's options and buckets.

runtime.compile adds the weights and writes the plan directory; the pre-flight checks
(runtime.args) plan from here alone, so that neither imports the other both ways.
"""

from __future__ import annotations

import os
from pathlib import Path

from ir import print_graph
from models.config import ModelConfig
from models.llama import lower
from passes.pipeline import PipelineOptions, memory_report, run_pipeline
from runtime.core.buckets import BucketTable
from runtime.config import CPU_DEVICE_MEMORY, EngineConfig

PLAN_VERSION = 1


def measure_device_memory(engine: EngineConfig) -> tuple[int, int | None]:
    """(device memory, what the allocator can still give) for one device, in bytes.

    On a GPU, JAX's allocator may hand out only `bytes_limit` (by default it preallocates
    XLA_PYTHON_CLIENT_MEM_FRACTION = 75% of the device), minus what is already held. The device
    total is bytes_limit / that fraction, so `memory_utilization` keeps vLLM's meaning (a
    fraction of the device) and the allocator's limit caps it. On CPU there is nothing to
    measure: a fixed budget (see EngineConfig), no separate limit. Explicit `device_memory` /
    `memory_limit` engine args override both.
    """
    total, limit = engine.device_memory, engine.memory_limit
    if total is None or limit is None:
        import jax

        dev = jax.local_devices()[0]
        stats = (dev.memory_stats() or {}) if dev.platform != "cpu" else {}
        if stats.get("bytes_limit"):
            preallocated = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() not in ("false", "0")
            platform_alloc = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform"
            fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
            bytes_limit = int(stats["bytes_limit"])
            if total is None:
                total = int(bytes_limit / fraction) if preallocated and not platform_alloc else bytes_limit
            if limit is None:
                limit = bytes_limit - int(stats.get("bytes_in_use", 0))
    return int(total if total is not None else CPU_DEVICE_MEMORY), limit


def pipeline_options(engine: EngineConfig, buckets: BucketTable, memory: tuple[int, int | None]) -> PipelineOptions:
    total, limit = memory
    return PipelineOptions(
        block_size=engine.block_size, max_model_len=engine.max_model_len, buckets=tuple(buckets.pairs()),
        device_memory_bytes=total, memory_limit_bytes=limit, memory_utilization=engine.memory_utilization,
        reserve_bytes=engine.reserve_bytes, num_kv_blocks=engine.num_kv_blocks,
        quantization=engine.quantization, tensor_parallel_size=engine.tensor_parallel_size,
        scan_layers=engine.scans_layers())


def is_plan_dir(path) -> bool:
    return Path(str(path)).is_dir() and (Path(str(path)) / "plan.json").exists()


def build_graph(config: ModelConfig, engine: EngineConfig, buckets: BucketTable,
                device_memory: int | None = None, keep_pass_texts: bool = True):
    graph = lower(config, engine.dtype)
    texts = [("lower", print_graph(graph))] if keep_pass_texts else []
    memory = (device_memory, engine.memory_limit) if device_memory else measure_device_memory(engine)
    opts = pipeline_options(engine, buckets, memory)
    graph = run_pipeline(graph, opts, on_pass=(lambda i, name, g: texts.append((name, print_graph(g))))
                         if keep_pass_texts else None)
    return graph, memory_report(graph, opts), texts
