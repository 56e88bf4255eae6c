"""The command-line layer every CLI shares: engine flags (vLLM's names), their units, and the
pre-flight check that turns a user's mistake into one actionable line before anything compiles.

The flags, their units and `--model` resolution are defined in config.flags (so that ir.dump can
share them) and re-exported here; the pre-flight checks, which plan and look at devices, are here.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import importlib.util
import json
import logging
import math
import socket
from pathlib import Path

from config.flags import (GiB, ArgumentParser, add_engine_args, check_max_model_len,  # noqa: F401 (re-exported)
                        engine_config_from_args, engine_kwargs_from_args, format_gib, parse_dtype,
                        parse_memory, resolve_model_config)
from config.engine_config import EngineConfig
from runtime.errors import UserError


def check_plan_dir(path: str) -> dict:
    """plan.json of a plan directory; UserError if it is missing or unreadable."""
    d = Path(path)
    make = f"create it with `jaxserve compile --model smollm2-135m --out {path}`"
    if not d.exists():
        raise UserError(f"--plan {path}: no such directory; {make}")
    if not (d / "plan.json").is_file():
        raise UserError(f"--plan {path}: not a plan directory (no plan.json); {make}")
    try:
        meta = json.loads((d / "plan.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--plan {path}: unreadable plan.json ({e}); recompile: {make}") from e
    from runtime.engine.plan import PLAN_VERSION

    if meta.get("version") != PLAN_VERSION:
        raise UserError(f"--plan {path}: plan version {meta.get('version')}, this engine reads version "
                        f"{PLAN_VERSION}; recompile: {make}")
    return meta


def check_port(host: str, port: int) -> None:
    """UserError if the server could not listen on host:port (busy, privileged, unknown host)."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port}: a port is 0..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve it ({e.strerror}); use an address such as "
                        f"127.0.0.1 or 0.0.0.0") from e
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is already in use (another server?); stop it "
                                f"or pass --port {port + 1 if port < 65535 else 8000}") from e
            if e.errno == errno.EACCES:
                raise UserError(f"--port {port}: permission denied (ports below 1024 need root); "
                                f"pass --port 8000") from e
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror}; check --host and --port") from e


def model_block_formats(model) -> dict[str, str]:
    """The GGUF blocks a model spec's weights will bring (a preset's or .gguf file's header index),
    so that a plan made before the weights load counts their bytes; {} for other specs."""
    from models.weights import gguf_block_formats

    try:
        return gguf_block_formats(model)
    except (OSError, ValueError):  # a spec that does not resolve: preflight says so elsewhere
        return {}


def plan_without_weights(config, engine: EngineConfig, block_formats: dict[str, str] | None = None):
    """(final graph, memory plan, bucket table) from the config alone, as a dry run makes them;
    `block_formats` (models.weights.gguf_block_formats) for the GGUF blocks the weights will bring."""
    from runtime.core.buckets import BucketTable
    from runtime.engine.plan import build_graph

    buckets = BucketTable.for_engine(engine)
    try:
        graph, memory, _ = build_graph(config, engine, buckets, keep_pass_texts=False, block_formats=block_formats)
    except ValueError as e:  # the passes refuse engine args that don't suit the model (e.g. its tp sizes)
        raise UserError(f"{config.name}: {e}") from e
    return graph, memory, buckets


def kv_fits(memory, engine: EngineConfig) -> bool:
    """Whether the KV cache holds at least one max_model_len sequence."""
    return memory.num_kv_blocks * engine.block_size >= engine.max_model_len


def _fits_with_change(config, engine: EngineConfig, block_formats=None, **change):
    """The memory plan with `change` applied if it fits, else None (also when the change is invalid)."""
    try:
        e = dataclasses.replace(engine, **change)
        memory = plan_without_weights(config, e, block_formats)[1]
    except (ValueError, UserError):  # e.g. a tensor-parallel size the model's dims don't divide by
        return None
    return memory if kv_fits(memory, e) else None


def fit_advice(config, engine: EngineConfig, memory, block_formats=None) -> list[str]:
    """Flag changes, each checked by re-planning, that would make the plan fit (smallest first)."""
    advice = []
    _fits_with = functools.partial(_fits_with_change, block_formats=block_formats)
    if engine.num_kv_blocks is not None:  # the override is what is short
        need = math.ceil(engine.max_model_len / engine.block_size)
        if _fits_with(config, engine, num_kv_blocks=need):
            advice.append(f"--num-kv-blocks {need} or more (or leave it to the memory plan)")
    elif memory.kv_cache_memory_bytes is not None:  # the KV size fixed (flag or VLLM_CPU_KVCACHE_SPACE) is short
        need = math.ceil(one_sequence_kv_bytes(memory, engine) / 2**20)
        if _fits_with(config, engine, kv_cache_memory_bytes=need << 20):
            advice.append(f"--kv-cache-memory {need}MiB or more")
    tps = [tp for tp in (2, 4, 8, 16) if tp > engine.tensor_parallel_size]
    for tp in tps:
        m = _fits_with(config, engine, tensor_parallel_size=tp)
        if m:
            advice.append(f"--tensor-parallel-size {tp} ({m.num_kv_blocks} KV blocks per device)")
            break
    if engine.dtype == "f32" and _fits_with(config, engine, dtype="bf16"):
        advice.append("--dtype bfloat16")
    if engine.quantization is None and _fits_with(config, engine, quantization="int8"):
        advice.append("--quantization int8")
    room = memory.num_kv_blocks * engine.block_size
    if room >= engine.block_size and _fits_with(config, engine, max_model_len=room):
        advice.append(f"--max-model-len {room} or less")
    if engine.memory_utilization < 0.95 and _fits_with(config, engine, memory_utilization=0.95):
        advice.append("--memory-utilization 0.95")
    if not advice:  # no single change is enough: try tensor parallelism with int8 weights
        for tp in tps:
            if engine.quantization is None and _fits_with(config, engine, tensor_parallel_size=tp,
                                                          quantization="int8"):
                advice.append(f"--tensor-parallel-size {tp} --quantization int8")
                break
    if engine.device_memory is not None:  # a what-if size (a dry run): say what size would do
        size = math.ceil(memory_needed(memory, engine) / GiB) * GiB
        if _fits_with(config, engine, device_memory=size):
            advice.append(f"--device-memory {size // GiB}GiB")
    return advice


def one_sequence_kv_bytes(memory, engine: EngineConfig) -> int:
    """KV bytes of one max_model_len sequence: its full-group blocks and its window group's (ir.kv_groups)."""
    seq_blocks = math.ceil(engine.max_model_len / engine.block_size)
    return (memory.kv_bytes_per_block * seq_blocks
            + memory.window_kv_bytes_per_block * memory.window_blocks_for(seq_blocks))


def memory_needed(memory, engine: EngineConfig) -> int:
    """Device memory (per device) the plan needs to hold one max_model_len sequence: weights, the
    activation peak, the reserve and that sequence's KV cache, over memory_utilization."""
    need = memory.weight_bytes + memory.peak_activation_bytes + memory.reserve_bytes + one_sequence_kv_bytes(memory, engine)
    return math.ceil(need / engine.memory_utilization)


def _memory_source(engine: EngineConfig, memory) -> str:
    """Where the plan's device memory came from, as a phrase with its size."""
    from config.engine_config import target_platform

    size = format_gib(memory.device_memory_bytes)
    if engine.device_memory is not None:
        return f"--device-memory gives {size}"
    if target_platform() == "cpu":
        per = " per device" if engine.tensor_parallel_size > 1 else ""
        return f"this host has {size}{per} available to plan for"
    return f"the device has {size}"


def fit_error(config, engine: EngineConfig, memory, block_formats=None) -> UserError | None:
    """Why the plan does not fit (None if it does): the KV cache is short of one max_model_len
    sequence, or the parts (an explicit --num-kv-blocks) overrun the budget."""
    from runtime.worker.model_runner import check_fit

    if not kv_fits(memory, engine):
        return not_fit_error(config, engine, memory, block_formats)
    try:
        check_fit(memory)
    except MemoryError as e:
        return UserError(str(e))
    return None


def not_fit_error(config, engine: EngineConfig, memory, block_formats=None) -> UserError:
    tp = f" per device at --tensor-parallel-size {engine.tensor_parallel_size}" if engine.tensor_parallel_size > 1 else ""
    advice = fit_advice(config, engine, memory, block_formats)
    fix = ("changes that fit: " + "; ".join(advice)) if advice else \
        "no flag change fits this model on this device; use a smaller model or more devices"
    tokens = memory.num_kv_blocks * engine.block_size
    if engine.num_kv_blocks is not None or memory.kv_cache_memory_bytes is not None:
        fixed = (f"--num-kv-blocks {engine.num_kv_blocks}" if engine.num_kv_blocks is not None else
                 f"a KV cache of {memory.kv_cache_memory_bytes / 2**20:.0f} MiB")
        return UserError(f"{config.name}: {fixed}{tp} holds {tokens} KV tokens, fewer than the "
                         f"{engine.max_model_len} that --max-model-len needs; {fix}")
    return UserError(
        f"{config.name} does not fit{tp}: it needs {format_gib(memory_needed(memory, engine))} (weights "
        f"{format_gib(memory.weight_bytes)} + activations {format_gib(memory.peak_activation_bytes)} + reserve "
        f"{format_gib(memory.reserve_bytes)} + one "
        f"{engine.max_model_len}-token sequence's KV cache {format_gib(one_sequence_kv_bytes(memory, engine))}, "
        f"at --memory-utilization {engine.memory_utilization}), and {_memory_source(engine, memory)}: room "
        f"for {tokens} KV tokens; {fix}")


def check_devices(tensor_parallel_size: int) -> None:
    """UserError unless JAX sees enough devices for the tensor-parallel size."""
    import jax

    n, backend = jax.device_count(), jax.default_backend()
    if tensor_parallel_size > n:
        fix = (f"on a CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel_size}"
               if backend == "cpu" else f"pass --tensor-parallel-size {n} or less")
        raise UserError(f"--tensor-parallel-size {tensor_parallel_size} needs {tensor_parallel_size} devices, "
                        f"JAX sees {n} ({backend}); {fix}")


def preflight(args, *, engine_kwargs: dict | None = None, dry_run: bool = False):
    """Checks a parsed command line before anything loads or compiles; raises UserError.

    Looks at what `args` has: `plan` (the directory and its plan.json), `model` (a preset, .gguf
    or HF directory; a plan directory is checked as a plan), the engine args (valid values,
    max_model_len within the model's positions) and `host`/`port` (free to listen on). Unless
    `dry_run`, also that the model's weights are there, that the memory plan holds one
    max_model_len sequence (else the changes that would fit), and that JAX has enough devices for
    the tensor-parallel size. `engine_kwargs` replaces the engine args read from `args`.
    Returns the model config (None for a plan).
    """
    from runtime.engine.plan import is_plan_dir

    plan = getattr(args, "plan", None)
    model = getattr(args, "model", None)
    if not plan and model and is_plan_dir(model):
        plan = model
    config = None
    if plan:
        check_plan_dir(plan)
    elif model:
        config = resolve_model_config(model, need_weights=not dry_run)
        try:
            engine = EngineConfig.from_kwargs(**(engine_kwargs or engine_kwargs_from_args(args)))
        except (ValueError, TypeError) as e:
            raise UserError(f"bad engine argument: {e}") from e
        check_max_model_len(config, engine.max_model_len)
        if not dry_run:
            formats = model_block_formats(model)
            error = fit_error(config, engine, plan_without_weights(config, engine, formats)[1], formats)
            if error:
                raise error
            check_devices(engine.tensor_parallel_size)
    if getattr(args, "port", None) is not None:
        check_port(getattr(args, "host", "127.0.0.1"), args.port)
    return config


class _NoTpuProbe(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to initialize backend 'tpu'" not in record.getMessage()


def quiet_tpu_probe() -> None:
    """Drops JAX's "Unable to initialize backend 'tpu': ... libtpu.so" line (logged on every start
    at the server's INFO level) where libtpu is not installed, so no TPU was meant. Other backend
    messages, such as a CUDA plugin that fails to load, still show."""
    if importlib.util.find_spec("libtpu") is None:
        logger = logging.getLogger("jax._src.xla_bridge")
        if not any(isinstance(f, _NoTpuProbe) for f in logger.filters):
            logger.addFilter(_NoTpuProbe())
