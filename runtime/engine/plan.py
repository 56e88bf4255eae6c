"""Model -> executable plan: lower, run the pass pipeline, size memory, convert weights (`compile_plan`);
`build_graph` (the graph half alone, which the pre-flight checks in runtime.entrypoints.args use), `Plan`
(save/load), and `load_plan` (a saved plan directory, or a fresh compile). The command line
is runtime/tools/compile.py; the AOT compilation of buckets happens in the runner (runtime/engine/build.py).

A plan directory holds plan.json (config, engine options, bucket table, memory plan, content
hash), ir/NN-<pass>.txt (the IR after each pass), the final graph, the weights as an Orbax
checkpoint, the tokenizer, and xla_cache/ (JAX's persistent compilation cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ir import Graph, parse_graph, print_graph
from models.config import ModelConfig
from passes.plan_memory import MemoryPlan
from models.llama import lower
from passes.pipeline import MEMORY_PASS, PipelineOptions, memory_report, run_pipeline
from runtime.core.buckets import BucketTable
from config.engine_config import CPU_DEVICE_MEMORY, EngineConfig, resolve_dtype, target_platform
from config.host_memory import cpu_kv_cache_space, read_host_memory

PLAN_VERSION = 2  # 2: params carry IR roles (ir/attrs.py)


def measure_device_memory(engine: EngineConfig) -> tuple[int, int | None]:
    """(device memory, what the allocator can still give) for one device, in bytes.

    On a GPU, JAX's allocator may hand out only `bytes_limit` (by default it preallocates
    XLA_PYTHON_CLIENT_MEM_FRACTION = 75% of the device), minus what is already held. The device
    total is bytes_limit / that fraction, so `memory_utilization` keeps vLLM's meaning (a
    fraction of the device) and the allocator's limit caps it. On CPU the device is the host: the
    memory it has available now, less a margin (config.host_memory; CPU_DEVICE_MEMORY where that
    cannot be read), no separate limit; the host devices that tensor parallelism forces share the
    one process's memory, so each gets its share. Explicit `device_memory` / `memory_limit`
    engine args override both.
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
    if total is None:  # a CPU: the process's budget, split across its tensor-parallel devices
        host = read_host_memory()
        total = (CPU_DEVICE_MEMORY if host is None else host) // engine.tensor_parallel_size
    return int(total), limit


def kv_pool_bounds(engine: EngineConfig) -> tuple[int | None, int | None]:
    """(max_kv_blocks, kv_cache_memory_bytes) for the memory plan (passes.plan_memory): on CPU the
    pool holds no more than the configuration can use (EngineConfig.kv_blocks_used), and
    VLLM_CPU_KVCACHE_SPACE, the process's CPU KV space shared by its tensor-parallel devices, fixes
    its bytes unless `kv_cache_memory_bytes` (per device) does. On GPU only the engine arg: the pool
    takes what the budget leaves, as vLLM's does."""
    if target_platform() != "cpu":
        return None, engine.kv_cache_memory_bytes
    fixed = engine.kv_cache_memory_bytes
    if fixed is None and (space := cpu_kv_cache_space()) is not None:
        fixed = space // engine.tensor_parallel_size
    return engine.kv_blocks_used(), fixed


def pipeline_options(engine: EngineConfig, buckets: BucketTable, memory: tuple[int, int | None],
                     block_formats: dict[str, str] | None = None) -> PipelineOptions:
    """`block_formats`: source weight -> GGUF block format, for the weights that came with blocks."""
    from runtime.worker.executor import reads_gguf_blocks, tile_activations, tiles_in_kernel, widens_half_weights

    total, limit = memory
    max_kv_blocks, kv_cache_memory_bytes = kv_pool_bounds(engine)
    return PipelineOptions(
        block_size=engine.block_size, max_model_len=engine.max_model_len, buckets=tuple(buckets.pairs()),
        device_memory_bytes=total, memory_limit_bytes=limit, memory_utilization=engine.memory_utilization,
        reserve_bytes=engine.reserve_bytes, num_kv_blocks=engine.num_kv_blocks,
        max_kv_blocks=max_kv_blocks, kv_cache_memory_bytes=kv_cache_memory_bytes,
        quantization=engine.quantization, quantize_lm_head=engine.quantize_lm_head,
        matmul_precision=engine.matmul_precision,
        block_formats=tuple(sorted(block_formats.items())) if reads_gguf_blocks(engine, bool(block_formats)) else (),
        block_tiles=tile_activations(engine), block_tiles_alone=tiles_in_kernel(engine),
        kv_dtype=engine.kv_dtype(), tensor_parallel_size=engine.tensor_parallel_size,
        expert_parallel=engine.enable_expert_parallel,  # scan_layers: build_graph, from the passes' graph
        widen_half_weights=widens_half_weights(engine))


def is_plan_dir(path) -> bool:
    return Path(str(path)).is_dir() and (Path(str(path)) / "plan.json").exists()


def build_graph(config: ModelConfig, engine: EngineConfig, buckets: BucketTable,
                device_memory: int | None = None, keep_pass_texts: bool = True,
                block_formats: dict[str, str] | None = None, memory: tuple[int, int | None] | None = None):
    """(final graph, memory plan, pass texts); `block_formats` as in pipeline_options; `memory`:
    measure_device_memory's answer, taken earlier (else measured now, or `device_memory`)."""
    from runtime.worker.executor import scans_layers

    graph = lower(config, engine.dtype)
    texts = [("lower", print_graph(graph))] if keep_pass_texts else []
    if memory is None:
        memory = (device_memory, engine.memory_limit) if device_memory else measure_device_memory(engine)
    opts = pipeline_options(engine, buckets, memory, block_formats)
    on_pass = (lambda i, name, g: texts.append((name, print_graph(g)))) if keep_pass_texts else None
    graph = run_pipeline(graph, opts, on_pass=on_pass, stop_before=MEMORY_PASS)
    # Whether the step scans can turn on what the passes made of the weights (GGUF tiles that stand
    # alone are read in place: runtime.worker.executor.scans_layers), and the memory plan counts
    # one layer's temporaries where it does: it plans for the layout the runner will take.
    opts = replace(opts, scan_layers=scans_layers(engine, sharded=engine.tensor_parallel_size > 1, graph=graph))
    graph = run_pipeline(graph, opts, on_pass=on_pass, start_at=MEMORY_PASS)
    return graph, memory_report(graph, opts), texts


# Engine args that only steer the host-side loop; a saved plan may be started with new values.
RUNTIME_ARGS = ("scheduling", "max_waiting_ms", "static_batch_size", "enable_prefix_caching", "seed",
                "kernel_backend", "scan_layers", "num_scheduler_steps", "speculative_config",
                "async_scheduling")


@dataclass
class Plan:
    """Everything the runtime needs to serve, with no lowering left to do."""

    config: ModelConfig
    engine: EngineConfig
    graph: Graph
    buckets: BucketTable
    memory: MemoryPlan
    pass_texts: list[tuple[str, str]] = field(default_factory=list)
    weights: dict[str, np.ndarray] | None = None  # final params (fused, maybe quantized)
    tokenizer: object | None = None
    directory: Path | None = None
    saved_hash: str | None = None  # content hash read from plan.json

    @property
    def num_kv_blocks(self) -> int:
        return self.memory.num_kv_blocks

    def program_hash(self) -> str:
        """A hash of what the compiled steps are made from: the model config, the engine options and
        the final graph (not the weights, which the steps take as arguments)."""
        h = hashlib.sha256()
        self._hash_program(h)
        return h.hexdigest()[:16]

    def _hash_program(self, h) -> None:
        h.update(json.dumps(self.config.to_dict(), sort_keys=True).encode())
        h.update(json.dumps(self.engine.to_dict(), sort_keys=True).encode())
        h.update(print_graph(self.graph).encode())

    def content_hash(self) -> str:
        h = hashlib.sha256()
        self._hash_program(h)
        for name in sorted(self.weights or {}):
            w = self.weights[name]
            h.update(name.encode())
            raw = getattr(w, "raw", w)  # a GGUF tensor's own bytes, not its values computed
            h.update(np.ascontiguousarray(np.ravel(raw)[:1024]).tobytes())  # a cheap fingerprint per tensor
            h.update(str(w.shape).encode())
        return h.hexdigest()[:16]

    def describe(self, memory: bool = True) -> str:
        """The model, the bucket table and, unless `memory=False` (the server prints the memory plan
        once, after the start measured it), the memory plan with the fit advice."""
        lines = [f"model {self.config.name}: {self.config.num_params() / 1e6:.1f}M params, "
                 f"{self.config.num_layers} layers, {self.config.num_q_heads} q heads / "
                 f"{self.config.num_kv_heads} kv heads, dtype {self.engine.dtype}",
                 f"buckets (tokens x seqs): {' '.join(f'{t}x{s}' for t, s in self.buckets.pairs())}"]
        if memory:
            lines.append(self.memory.table())
        tp = self.graph.meta_value("tp", 1)
        if tp > 1:
            lines.append(f"  tensor parallel over {tp} devices: attention {self.graph.meta_value('tp_attention')}, "
                         f"MLP and vocab split; replicated weights count fully on every device")
            lines += [f"  note: {n}" for n in self.graph.meta_value("tp_notes", ()) or ()]
        if memory and self.memory.num_kv_blocks * self.engine.block_size < self.engine.max_model_len:
            # Only advice that changes something: no "--dtype bfloat16" for a bf16 plan, no int8 twice.
            shrink = [opt for opt, done in (("--dtype bfloat16", self.engine.dtype != "f32"),
                                            ("--quantization int8", self.engine.quantization is not None)) if not done]
            lines.append(f"does not fit: the KV cache cannot hold one {self.engine.max_model_len}-token "
                         "sequence; raise --device-memory, --memory-utilization or --tensor-parallel-size, "
                         + (f"use {' or '.join(shrink)}, " if shrink else "") + "or lower --max-model-len")
        return "\n".join(lines)

    # -------------------------------------------------------------- save / load

    def save(self, out: str | os.PathLike, *, weights: bool = True) -> Path:
        from models.weights import save_orbax

        out = Path(out).absolute()
        (out / "ir").mkdir(parents=True, exist_ok=True)
        for i, (name, text) in enumerate(self.pass_texts):
            (out / "ir" / f"{i:02d}-{name}.txt").write_text(text)
        (out / "graph.txt").write_text(print_graph(self.graph))
        if self.weights is not None and weights:
            save_orbax(self.weights, out / "weights", force=True)
        if self.tokenizer is not None:
            self.tokenizer.save(out / "tokenizer")
        meta = {"version": PLAN_VERSION, "config": self.config.to_dict(), "engine": self.engine.to_dict(),
                "buckets": self.buckets.to_dict(), "memory": self.memory.to_dict(),
                "content_hash": self.content_hash()}
        (out / "plan.json").write_text(json.dumps(meta, indent=1))
        self.directory = out
        self.saved_hash = meta["content_hash"]
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike, load_weights: bool = True) -> "Plan":
        from models.tokenizer import Tokenizer
        from models.weights import load_orbax

        d = Path(directory)
        try:
            meta = json.loads((d / "plan.json").read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{d}: not a plan directory (no plan.json)") from None
        if meta.get("version") != PLAN_VERSION:
            raise ValueError(f"{d}/plan.json: plan version {meta.get('version')} != {PLAN_VERSION}; recompile")
        graph = parse_graph((d / "graph.txt").read_text())
        tok = Tokenizer.from_file(d / "tokenizer") if (d / "tokenizer" / "tokenizer.json").exists() else None
        weights = load_orbax(d / "weights") if load_weights and (d / "weights").exists() else None
        return cls(ModelConfig.from_dict(meta["config"]), EngineConfig(**meta["engine"]), graph,
                   BucketTable.from_dict(meta["buckets"]), MemoryPlan.from_dict(meta["memory"]),
                   weights=weights, tokenizer=tok, directory=d.absolute(),
                   saved_hash=meta.get("content_hash"))


def resolve_model(model) -> tuple[ModelConfig, dict | None, object | None]:
    """(config, weights, tokenizer) for a preset name, GGUF file or HF directory."""
    from models.weights import load_model

    return load_model(model)


def weight_block_formats(weights) -> dict[str, str]:
    """Source weight -> GGUF block format, for the weights a loader gave blocks (ir.blocks)."""
    from ir.blocks import split_blocks_name

    return dict(split for key in weights if (split := split_blocks_name(key)) is not None)


def compile_plan(model, engine: EngineConfig | None = None, *, progress: bool = False,
                 weights=None, config: ModelConfig | None = None, tokenizer=None) -> Plan:
    """Lowers the model, runs the passes, and materializes the final weights (in memory)."""
    from runtime.worker.params import materialize

    engine = engine or EngineConfig()
    # Before the weights load: on CPU they land in the host memory that the plan's budget measures,
    # and the plan counts them itself.
    memory = measure_device_memory(engine)
    if config is None:
        config, weights, tokenizer = resolve_model(model)
    if engine.max_model_len > config.max_position_embeddings:
        raise ValueError(f"max_model_len {engine.max_model_len} exceeds the model's "
                         f"max_position_embeddings {config.max_position_embeddings}")
    buckets = BucketTable.for_engine(engine)
    graph, memory, texts = build_graph(config, engine, buckets, block_formats=weight_block_formats(weights or {}),
                                       memory=memory)
    if memory.num_kv_blocks * engine.block_size < engine.max_model_len:
        raise ValueError(
            f"the KV cache fits {memory.num_kv_blocks} blocks ({memory.num_kv_blocks * engine.block_size} "
            f"tokens), fewer than max_model_len={engine.max_model_len}; raise memory_utilization or "
            f"device_memory, or lower max_model_len\n{memory.table()}")
    final = None
    if weights is not None:
        bar = _progress("convert weights") if progress else None
        final = materialize(graph, weights, progress=bar)
    return Plan(config, engine, graph, buckets, memory, texts, final, tokenizer)


def _progress(desc: str):
    from tqdm import tqdm

    return lambda it: tqdm(it, desc=desc, unit="tensor", file=sys.stderr)


def load_plan(model, engine_args: dict, progress: bool = False) -> Plan:
    """A saved plan directory (runtime args may be overridden), or a fresh in-memory compile
    (`progress`: a bar for the weights' conversion)."""
    if is_plan_dir(model):
        plan = Plan.load(model)
        fixed = {k: v for k, v in engine_args.items() if k not in RUNTIME_ARGS and k != "gpu_memory_utilization"}
        if "dtype" in fixed:
            fixed["dtype"] = resolve_dtype(fixed["dtype"])
        for k, v in fixed.items():
            if getattr(plan.engine, k, v) != v:
                raise ValueError(f"{model} was compiled with {k}={getattr(plan.engine, k)!r}; "
                                 f"recompile the plan to use {k}={v!r}")
        for k in RUNTIME_ARGS:
            if k in engine_args:
                setattr(plan.engine, k, engine_args[k])
        return plan
    return compile_plan(model, EngineConfig.from_kwargs(**engine_args), progress=progress)
