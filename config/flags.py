"""The command-line basics every CLI shares: one-line user errors, engine flags and their units,
and `--model` resolution. `runtime.entrypoints.args` and `runtime.errors` re-export them; `ir.dump` imports
them from here, since the layering lets it import models and passes but not runtime.

A `UserError` is a mistake the person at the keyboard can fix (a model that does not exist, a
busy port, a plan that does not fit). `run_main` prints it as `error: ...` with no traceback;
`--debug` (anywhere on the command line) or JAXSERVE_DEBUG=1 re-raises it with the traceback.
Anything else is a bug and keeps its traceback.

Memory sizes take `80`, `80G`, `80GiB` or `512MiB`; a bare number is GiB. Dtypes take `auto` and
the aliases of config.engine_config (float32/fp32/f32, bfloat16/bf16, float16/half/f16).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from config.engine_config import (CPU_DEVICE_MEMORY, DTYPE_ALIASES, GGUF_ACTIVATIONS, KERNEL_BACKENDS,
                                  KV_CACHE_DTYPES, MATMUL_PRECISIONS, QUANTIZATIONS, EngineConfig)

USER_ERROR_EXIT = 2  # argparse's exit code for a bad command line


class UserError(Exception):
    """A mistake in what the user asked for; the message names it and the fix."""


class DoesNotFit(UserError, MemoryError):
    """A setting the user chose does not fit the device's memory (a MemoryError to callers of the
    Python API; one `error:` line on the command line). The message gives the numbers and a change
    that fits."""


def split_debug(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """(debug?, argv without `--debug`); JAXSERVE_DEBUG=1 also turns debugging on."""
    argv = list(argv)
    debug = os.environ.get("JAXSERVE_DEBUG", "").lower() in ("1", "true", "yes", "on")
    if "--" in argv:  # everything after `--` belongs to the command
        head, tail = argv[:argv.index("--")], argv[argv.index("--"):]
    else:
        head, tail = argv, []
    if "--debug" in head:
        debug = True
        head = [a for a in head if a != "--debug"]
    return debug, head + tail


def run_main(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Runs `main(argv)`; a UserError becomes one `error:` line on stderr and exit code 2."""
    debug, argv = split_debug(sys.argv[1:] if argv is None else argv)
    try:
        return int(main(argv) or 0)
    except UserError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130


# ------------------------------------------------------------------------------ flags

GiB = 1 << 30
_MEMORY_UNITS = {"": GiB, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20,
                 "mib": 1 << 20, "mb": 10**6, "g": GiB, "gib": GiB, "gb": 10**9, "t": 1 << 40,
                 "tib": 1 << 40, "tb": 10**12}
DTYPE_CHOICES = ("auto", *DTYPE_ALIASES)


# What to call a command in its messages when the user reached it another way than `python -m`:
# "MODULE=NAME" (runtime.tools.cli sets "runtime.serve=jaxserve serve"; scripts/serve.sh
# "runtime.serve=scripts/serve.sh"), so an error names the command the user typed.
PROG_ENV = "JAXSERVE_PROG"


def shown_prog(prog: str) -> str:
    """`prog` ("python -m runtime.bench serve") as the user invoked it ("jaxserve bench serve")."""
    module, _, name = os.environ.get(PROG_ENV, "").partition("=")
    head = f"python -m {module}"
    if module and name and (prog == head or prog.startswith(head + " ")):
        return name + prog[len(head):]
    return prog


def did_you_mean(word: str, choices, cutoff: float = 0.6) -> str:
    """" (did you mean X?)" for the closest of `choices`, or the two closest when they are about as
    close (flags compared without their dashes; a word that is part of exactly one choice names
    it), or ""."""
    bare = {str(c).lstrip("-"): str(c) for c in choices}
    key = str(word).lstrip("-")
    close = difflib.get_close_matches(key, list(bare), n=2, cutoff=cutoff)
    if len(close) == 2 and _likeness(key, close[1]) < _likeness(key, close[0]) - 0.05:
        close = close[:1]  # a clearly closer one is the suggestion
    if not close:
        close = [c for c in bare if key and key in c]
        close = close if len(close) == 1 else []
    return f" (did you mean {' or '.join(bare[c] for c in close)}?)" if close else ""


def _likeness(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `error: ... (see PROG --help)`, exit 2, with no usage
    dump and a "did you mean" for a mistyped flag or choice. vLLM's underscore spellings of flags
    (`--max_model_len`) are taken as the dashed ones, and PROG is the command the user typed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        typed = shown_prog(self.prog)
        if typed != self.prog:  # the help's examples too: `jaxserve serve --help` shows `jaxserve serve ...`
            self.description, self.epilog = (t.replace(self.prog + " ", typed + " ") if isinstance(t, str) else t
                                             for t in (self.description, self.epilog))
        self.prog = typed

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._dashed(args), namespace)

    def _dashed(self, args: list[str]) -> list[str]:
        """`--max_model_len 512` and `--max_model_len=512` as `--max-model-len`, when that is a flag
        here (everything after `--` is left alone)."""
        out = []
        for i, a in enumerate(args):
            if a == "--":
                return out + args[i:]
            flag, eq, value = a.partition("=")
            if flag.startswith("--") and "_" in flag and flag not in self._option_string_actions:
                dashed = "--" + flag[2:].replace("_", "-")
                if dashed in self._option_string_actions:
                    a = dashed + eq + value
            out.append(a)
        return out

    def error(self, message):
        self.exit(2, f"error: {self._suggest(message)} (see {self.prog} --help)\n")

    def _suggest(self, message: str) -> str:
        flags = [f for f in self._option_string_actions if f.startswith("--")]
        if message.startswith("unrecognized arguments: "):
            words = message[len("unrecognized arguments: "):].split()
            unknown = [w.split("=")[0] for w in words if w.startswith("-")]
            if not unknown:
                return f"unexpected argument{'s' * (len(words) > 1)}: {' '.join(words)}"
            named = ", ".join(w + did_you_mean(w, flags) for w in unknown)
            return f"unknown flag{'s' * (len(unknown) > 1)} {named}"
        if "invalid choice: " in message and "(choose from " in message:
            action = next((a for a in self._actions if a.choices and message.startswith(
                f"argument {argparse._get_action_name(a)}:")), None)
            if action is not None:
                value = message.split("invalid choice: ", 1)[1].split(" (choose from", 1)[0].strip("'\"")
                choices = [str(c) for c in action.choices if c is not None]
                flag = action.option_strings[0] if action.option_strings else argparse._get_action_name(action)
                return f"{flag} {value!r} is not one of {', '.join(choices)}{did_you_mean(value, choices)}"
        return message


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
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}{_dtype_hint(name)}: use auto, "
                                         f"float32, bfloat16 or float16 (aliases: {', '.join(sorted(DTYPE_ALIASES))})")
    return name


def _dtype_hint(name: str) -> str:
    """The closest spellings of up to two different dtypes (`bf32`: f32 or bf16)."""
    seen, picks = set(), []
    for c in difflib.get_close_matches(name, DTYPE_CHOICES, n=len(DTYPE_CHOICES), cutoff=0.5):
        if DTYPE_ALIASES.get(c, c) not in seen:
            seen.add(DTYPE_ALIASES.get(c, c))
            picks.append(c)
    return f" (did you mean {' or '.join(picks[:2])}?)" if picks else ""


def format_gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.1f} GiB"


# The one flag table: (field, flags, argparse kwargs, vLLM's equivalent). Defaults come from
# EngineConfig unless a command overrides them. Each help is one line of meaning (docs/configuration.md
# is generated from this table: `python -m config.doc`); measurements live in the guides.
_ENGINE_FLAGS = (
    ("max_model_len", ("--max-model-len",), dict(type=int, help="longest prompt + output, in tokens"),
     "--max-model-len"),
    ("max_num_seqs", ("--max-num-seqs",), dict(type=int, help="sequences in one step"), "--max-num-seqs"),
    ("max_num_batched_tokens", ("--max-num-batched-tokens",),
     dict(type=int, help="tokens in one step (the largest token bucket)"), "--max-num-batched-tokens"),
    ("block_size", ("--block-size",), dict(type=int, help="tokens per KV block (a power of two)"), "--block-size"),
    ("memory_utilization", ("--memory-utilization", "--gpu-memory-utilization"),
     dict(type=float, help="share of device memory the plan may use (weights + activations + KV cache)"),
     "--gpu-memory-utilization"),
    ("device_memory", ("--device-memory",),
     dict(type=parse_memory, metavar="SIZE",
          help="device memory to plan for: 80 (GiB), 80GiB or 512MiB (default: measured on GPU; on CPU the "
               "host's available memory at start less a margin, split across its tensor-parallel devices, "
               f"or {CPU_DEVICE_MEMORY // GiB} GiB where it cannot be read)"),
     "none (vLLM measures the device)"),
    ("kv_cache_memory_bytes", ("--kv-cache-memory", "--kv-cache-memory-bytes"),
     dict(type=parse_memory, metavar="SIZE",
          help="the KV cache's size per device, fixed: 2GiB, 2G or 512MiB (default: on CPU "
               "VLLM_CPU_KVCACHE_SPACE, else what max_num_seqs x max_model_len use and a quarter more for the "
               "prefix cache, within the budget; on GPU what the budget leaves)"),
     "--kv-cache-memory-bytes"),
    ("num_kv_blocks", ("--num-kv-blocks",), dict(type=int, help="override the KV block count the memory plan gives"),
     "--num-gpu-blocks-override"),
    ("dtype", ("--dtype",),
     dict(type=parse_dtype, metavar="DTYPE",
          help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16"), "--dtype"),
    ("enable_prefix_caching", ("--enable-prefix-caching",),
     dict(type=_bool, metavar="BOOL", help="reuse the KV blocks of shared prompt prefixes"), "--enable-prefix-caching"),
    ("enable_chunked_prefill", ("--enable-chunked-prefill",),
     dict(type=_bool, metavar="BOOL", help="split long prompts across steps so decodes never stall"),
     "--enable-chunked-prefill"),
    ("scheduling", ("--scheduling",), dict(help="continuous (default), dynamic or static batching"),
     "none (vLLM batches continuously)"),
    ("max_waiting_ms", ("--max-waiting-ms",),
     dict(type=float, help="dynamic batching: the longest a request waits for its batch to fill"), "none"),
    ("tensor_parallel_size", ("--tensor-parallel-size", "-tp"),
     dict(type=int, help="shard the model over this many devices"), "--tensor-parallel-size"),
    ("enable_expert_parallel", ("--enable-expert-parallel",),
     dict(type=_bool, metavar="BOOL", help="mixture of experts under --tensor-parallel-size: split the experts "
          "among the devices, not each expert's columns"), "--enable-expert-parallel"),
    ("quantization", ("--quantization",),
     dict(default=None, choices=QUANTIZATIONS, help="int8: int8 weights widened in the product; w8a8: int8 weights "
          "and per-token int8 activations, an int8 x int8 product"), "--quantization (other methods)"),
    ("quantize_lm_head", ("--quantize-lm-head",),
     dict(type=_bool, metavar="BOOL", help="with --quantization: true puts the LM head in int8 too, false keeps it "
          "in full precision (default: w8a8 quantizes it; int8 keeps a tied head)"), "none"),
    ("matmul_precision", ("--matmul-precision",),
     dict(choices=MATMUL_PRECISIONS, help="bfloat16: an f32 plan's steps of 4+ rows multiply in bf16 from a bf16 "
          "copy of the weights, accumulating in f32 (weight memory x1.5)"), "none"),
    ("gguf_blocks", ("--gguf-blocks",),
     dict(type=_bool, metavar="BOOL", help="decode steps read a GGUF model's Q4_0/Q4_1/Q8_0 weights from the file's "
          "own blocks (default: on where the C++ CPU kernels have their vector path)"), "none"),
    ("gguf_activations", ("--gguf-activations",),
     dict(choices=GGUF_ACTIVATIONS, help="q8: the products on a GGUF model's blocks multiply in int8, activations "
          "rounded per block of 32 to 8 bits, as llama.cpp does (default f32)"), "none"),
    ("gguf_tiles", ("--gguf-tiles",),
     dict(type=_bool, metavar="BOOL", help="repack a GGUF model's blocks into tiles of 16 columns that every step "
          "reads (default: on with --gguf-activations q8, and where the C++ kernels multiply f32 activations by "
          "tiles: AVX-512BW, or AVX2 with FMA)"), "none"),
    ("kv_cache_dtype", ("--kv-cache-dtype",),
     dict(choices=KV_CACHE_DTYPES, help="auto (the model's dtype) or bfloat16: K/V stored in bf16, attention "
          "computed in f32"), "--kv-cache-dtype (fp8 not built)"),
    ("seed", ("--seed",), dict(type=int, help="the seed of requests that give none"), "--seed"),
    ("kernel_backend", ("--kernel-backend",),
     dict(choices=KERNEL_BACKENDS, help="auto (Pallas on GPU; on CPU our C++ kernels where they build, else XLA), "
          "xla, cpp, pallas or interpret"), "VLLM_ATTENTION_BACKEND (environment)"),
    ("scan_layers", ("--scan-layers",),
     dict(type=_bool, metavar="BOOL", help="run the decoder layers as one lax.scan, so XLA compiles one layer "
          "(default: on GPU/TPU; on CPU under tensor parallelism and where the C++ kernels read a layer in "
          "place)"), "none"),
    ("num_scheduler_steps", ("--num-scheduler-steps",),
     dict(type=int, help="decode steps per executable for all-decode batches (vLLM's multi-step)"),
     "--num-scheduler-steps (vLLM V0)"),
    ("async_scheduling", ("--async-scheduling",),
     dict(type=_bool, metavar="BOOL", help="schedule step N+1 while step N runs, decode tokens fed on the device "
          "(default: on GPU/TPU, except with multi-step, speculative decoding or TP; off on CPU)"),
     "--async-scheduling"),
    ("speculative_config", ("--speculative-config",),
     dict(metavar="JSON", help='speculative decoding as JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
          "(n-gram prompt lookup)"), "--speculative-config"),
)

# EngineConfig fields with no flag: set through LLM(...) or a saved plan only.
NO_FLAG_FIELDS = ("static_batch_size", "memory_limit", "reserve_bytes")
# The fields engine_kwargs_from_args passes on as they are (device_memory is converted there).
ENGINE_FIELDS = tuple(name for name, *_ in _ENGINE_FLAGS if name != "device_memory")


def add_engine_args(ap: argparse.ArgumentParser, only=None, defaults=None) -> None:
    """Adds the engine flags (all, or the fields in `only`), with EngineConfig's defaults."""
    d = EngineConfig.__dataclass_fields__
    defaults = defaults or {}
    g = ap.add_argument_group("engine")
    for name, flags, kw, _ in _ENGINE_FLAGS:
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
    from models.weights import PACKAGED_GGUF, packaged_gguf_problem

    if name == "tiny":
        return None
    if name in PACKAGED_GGUF:
        return packaged_gguf_problem(name)
    return (f"preset {name!r} has no bundled weights: pass --model path/to/model.gguf or an HF "
            f"directory (config.json + safetensors); `jaxserve compile --model {name} --dry-run` "
            f"plans it without weights")


def resolve_model_config(spec: str, *, need_weights: bool = True):
    """The ModelConfig of a preset, .gguf file, HF directory or config.json, reading only metadata.

    Raises UserError naming the problem: an unknown name (with the closest presets), a missing
    file, a preset without bundled weights (when `need_weights`), a directory that is no model.
    """
    from models.config import PRESETS, config_from_hf

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
            from models.weights import gguf_config, read_gguf_index

            fields, tensors = read_gguf_index(path)  # metadata only; tensors are not dequantized
            return gguf_config(fields, tensors, name=path.stem)
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
