"""The command-line layer every CLI shares: engine flags (vLLM's names), their units, and the
pre-flight check that turns a user's mistake into one actionable line before anything compiles.

Memory sizes take `80`, `80G`, `80GiB` or `512MiB`; a bare number is GiB. Dtypes take `auto` and
the aliases of runtime.config (float32/fp32/f32, bfloat16/bf16, float16/half/f16).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import errno
import json
import math
import socket
from pathlib import Path

from runtime.config import CPU_DEVICE_MEMORY, DTYPE_ALIASES, EngineConfig
from runtime.errors import UserError

GiB = 1 << 30
_MEMORY_UNITS = {"": GiB, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20,
                 "mib": 1 << 20, "mb": 10**6, "g": GiB, "gib": GiB, "gb": 10**9, "t": 1 << 40,
                 "tib": 1 << 40, "tb": 10**12}
DTYPE_CHOICES = ("auto", *DTYPE_ALIASES)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `error: ... (see PROG --help)`, exit 2, with no usage dump."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {v!r}")


def parse_memory(text: str) -> int:
    """`80` (GiB), `80G`, `80GiB`, `512MiB`, `1.5T`, `1073741824B` -> bytes (> 0)."""
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = None
    if value is None or unit not in _MEMORY_UNITS or value <= 0:
        raise argparse.ArgumentTypeError(
            f"bad memory size {text!r}: use e.g. 80 (GiB), 80GiB, 80G or 512MiB")
    return int(value * _MEMORY_UNITS[unit])


def parse_dtype(text: str) -> str:
    name = str(text).lower()
    if name not in DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: use auto, float32, bfloat16 or float16 "
                                         f"(aliases: {', '.join(sorted(DTYPE_ALIASES))})")
    return name


def format_gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.1f} GiB"


# (field, flags, argparse kwargs); defaults come from EngineConfig unless a command overrides them.
_ENGINE_FLAGS = (
    ("max_model_len", ("--max-model-len",), dict(type=int, help="longest prompt + output")),
    ("max_num_seqs", ("--max-num-seqs",), dict(type=int, help="sequences in one step")),
    ("max_num_batched_tokens", ("--max-num-batched-tokens",),
     dict(type=int, help="tokens in one step (the largest token bucket)")),
    ("block_size", ("--block-size",), dict(type=int, help="tokens per KV block")),
    ("memory_utilization", ("--memory-utilization", "--gpu-memory-utilization"),
     dict(type=float, help="share of device memory the plan may use")),
    ("device_memory", ("--device-memory",),
     dict(type=parse_memory, metavar="SIZE",
          help="device memory to plan for: 80 (GiB), 80GiB or 512MiB (default: measured on GPU, "
               f"{CPU_DEVICE_MEMORY // GiB} GiB on CPU)")),
    ("num_kv_blocks", ("--num-kv-blocks",), dict(type=int, help="override the planned KV block count")),
    ("dtype", ("--dtype",),
     dict(type=parse_dtype, metavar="DTYPE",
          help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16")),
    ("enable_prefix_caching", ("--enable-prefix-caching",), dict(type=_bool, metavar="BOOL")),
    ("enable_chunked_prefill", ("--enable-chunked-prefill",), dict(type=_bool, metavar="BOOL")),
    ("scheduling", ("--scheduling",), dict(help="continuous (default), dynamic or static")),
    ("max_waiting_ms", ("--max-waiting-ms",), dict(type=float)),
    ("tensor_parallel_size", ("--tensor-parallel-size", "-tp"), dict(type=int)),
    ("quantization", ("--quantization",), dict(default=None, choices=(None, "int8"))),
    ("seed", ("--seed",), dict(type=int)),
    ("kernel_backend", ("--kernel-backend",), dict(choices=("auto", "xla", "pallas", "interpret"))),
)

ENGINE_FIELDS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "memory_utilization", "dtype", "enable_prefix_caching", "enable_chunked_prefill",
                 "scheduling", "max_waiting_ms", "tensor_parallel_size", "quantization", "seed",
                 "num_kv_blocks", "kernel_backend")


def add_engine_args(ap: argparse.ArgumentParser, only=None, defaults=None) -> None:
    """Adds the engine flags (all, or the fields in `only`), with EngineConfig's defaults."""
    d = EngineConfig.__dataclass_fields__
    defaults = defaults or {}
    g = ap.add_argument_group("engine")
    for name, flags, kw in _ENGINE_FLAGS:
        if only is not None and name not in only:
            continue
        kw = dict(kw, dest=name)
        kw["default"] = defaults.get(name, kw.get("default", d[name].default))
        g.add_argument(*flags, **kw)


def engine_kwargs_from_args(args) -> dict:
    kw = {f: getattr(args, f) for f in ENGINE_FIELDS}
    if args.device_memory:
        kw["device_memory"] = int(args.device_memory)  # bytes, from parse_memory
    return kw


def engine_config_from_args(args) -> EngineConfig:
    return EngineConfig.from_kwargs(**engine_kwargs_from_args(args))


# ------------------------------------------------------------------------------ pre-flight

def _preset_weights_problem(name: str) -> str | None:
    """Why a preset's weights can't be loaded (None: they can). Mirrors models.weights.load_model."""
    if name == "tiny":
        return None
    if name == "smollm2-135m":
        from models.weights import find_smollm2_gguf

        try:
            find_smollm2_gguf()
        except FileNotFoundError as e:
            return str(e)
        return None
    return (f"preset {name!r} has no bundled weights: pass --model path/to/model.gguf or an HF "
            f"directory (config.json + safetensors); `jaxserve compile --model {name} --dry-run` "
            f"plans it without weights")


def resolve_model_config(spec: str, *, need_weights: bool = True):
    """The ModelConfig of a preset, .gguf file, HF directory or config.json, reading only metadata.

    Raises UserError naming the problem: an unknown name (with the closest presets), a missing
    file, a preset without bundled weights (when `need_weights`), a directory that is no model.
    """
    from models.config import PRESETS, config_from_gguf_fields, config_from_hf

    spec = str(spec)
    if spec in PRESETS:
        problem = _preset_weights_problem(spec) if need_weights else None
        if problem:
            raise UserError(problem)
        return PRESETS[spec]
    path = Path(spec)
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise UserError(f"--model {spec}: a directory with no config.json (an HF model) and no "
                                f"plan.json (a plan from `jaxserve compile`)")
            if need_weights and not any(path.glob("*.safetensors*")):
                raise UserError(f"--model {spec}: no *.safetensors weights next to config.json")
            return config_from_hf(path)
        if path.name == "config.json" and path.is_file() and not need_weights:
            return config_from_hf(path)
        if path.is_file() and path.suffix == ".gguf":
            from models.weights import read_gguf_fields

            reader, fields = read_gguf_fields(path)  # metadata only; tensors are not dequantized
            tensors = {t.name for t in reader.tensors}
            config = config_from_gguf_fields(dict(fields, _tied="output.weight" not in tensors), name=path.stem)
            return config.replace(qkv_bias="blk.0.attn_q.bias" in tensors)
    except (ValueError, FileNotFoundError) as e:
        raise UserError(f"--model {spec}: {e}") from e
    if path.exists():
        raise UserError(f"--model {spec}: cannot tell how to load this; expected a preset, a .gguf "
                        f"file, an HF directory or a plan directory")
    close = difflib.get_close_matches(spec, PRESETS, n=1, cutoff=0.5)
    hint = f"did you mean --model {close[0]}? " if close else ""
    raise UserError(f"unknown model {spec!r}: no such preset, file or directory; {hint}"
                    f"presets: {', '.join(sorted(PRESETS))}")


def check_max_model_len(config, max_model_len: int) -> None:
    if max_model_len > config.max_position_embeddings:
        raise UserError(f"--max-model-len {max_model_len} is longer than {config.name} supports "
                        f"(max_position_embeddings {config.max_position_embeddings}); pass "
                        f"--max-model-len {config.max_position_embeddings} or less")


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
    from runtime.compile import PLAN_VERSION

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


def plan_without_weights(config, engine: EngineConfig):
    """(final graph, memory plan, bucket table) from the config alone, as a dry run makes them."""
    from runtime.buckets import BucketTable
    from runtime.compile import build_graph

    buckets = BucketTable.build(engine.max_num_batched_tokens, engine.max_num_seqs)
    try:
        graph, memory, _ = build_graph(config, engine, buckets, keep_pass_texts=False)
    except ValueError as e:  # the passes refuse engine args that don't suit the model (e.g. its tp sizes)
        raise UserError(f"{config.name}: {e}") from e
    return graph, memory, buckets


def kv_fits(memory, engine: EngineConfig) -> bool:
    """Whether the KV cache holds at least one max_model_len sequence."""
    return memory.num_kv_blocks * engine.block_size >= engine.max_model_len


def _fits_with(config, engine: EngineConfig, **change):
    """The memory plan with `change` applied if it fits, else None (also when the change is invalid)."""
    try:
        e = dataclasses.replace(engine, **change)
        memory = plan_without_weights(config, e)[1]
    except (ValueError, UserError):  # e.g. a tensor-parallel size the model's dims don't divide by
        return None
    return memory if kv_fits(memory, e) else None


def fit_advice(config, engine: EngineConfig, memory) -> list[str]:
    """Flag changes, each checked by re-planning, that would make the plan fit (smallest first)."""
    advice = []
    if engine.num_kv_blocks is not None:  # the override is what is short
        need = math.ceil(engine.max_model_len / engine.block_size)
        if _fits_with(config, engine, num_kv_blocks=need):
            advice.append(f"--num-kv-blocks {need} or more (or leave it to the memory plan)")
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
        need = (memory.weight_bytes + memory.peak_activation_bytes + memory.reserve_bytes
                + memory.kv_bytes_per_block * math.ceil(engine.max_model_len / engine.block_size))
        size = math.ceil(need / engine.memory_utilization / GiB) * GiB
        if _fits_with(config, engine, device_memory=size):
            advice.append(f"--device-memory {size // GiB}GiB")
    return advice


def fit_error(config, engine: EngineConfig, memory) -> UserError | None:
    """Why the plan does not fit (None if it does): the KV cache is short of one max_model_len
    sequence, or the parts (an explicit --num-kv-blocks) overrun the budget."""
    from runtime.model_runner import check_fit

    if not kv_fits(memory, engine):
        return not_fit_error(config, engine, memory)
    try:
        check_fit(memory)
    except MemoryError as e:
        return UserError(str(e))
    return None


def not_fit_error(config, engine: EngineConfig, memory) -> UserError:
    tp = f" per device at --tensor-parallel-size {engine.tensor_parallel_size}" if engine.tensor_parallel_size > 1 else ""
    advice = fit_advice(config, engine, memory)
    fix = ("changes that fit: " + "; ".join(advice)) if advice else \
        "no flag change fits this model on this device; use a smaller model or more devices"
    return UserError(
        f"{config.name} does not fit{tp}: weights {format_gib(memory.weight_bytes)} + activations "
        f"{format_gib(memory.peak_activation_bytes)} leave room for {memory.num_kv_blocks * engine.block_size} "
        f"KV tokens of the {engine.max_model_len} that --max-model-len needs, in "
        f"{format_gib(memory.budget_bytes)} usable of {format_gib(memory.device_memory_bytes)}; {fix}")


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
    from runtime.compile import is_plan_dir

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
            error = fit_error(config, engine, plan_without_weights(config, engine)[1])
            if error:
                raise error
            check_devices(engine.tensor_parallel_size)
    if getattr(args, "port", None) is not None:
        check_port(getattr(args, "host", "127.0.0.1"), args.port)
    return config
