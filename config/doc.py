"""The reference pages generated from the code, so that they cannot drift from it.

docs/configuration.md, from the one flag table (config.flags._ENGINE_FLAGS) and EngineConfig's
fields and defaults: a flag's name, type, default, meaning and vLLM equivalent.

    python -m config.doc > docs/configuration.md

docs/server-flags.md, from the server's own parser (the flags of `jaxserve serve` that are not
engine flags) and ENV_VARS below, the environment variables the project reads. config/ may not
import runtime/ (tests/test_layering.py), so the server's parser is handed in:

    python -c "from config.doc import server_markdown; from runtime.entrypoints.openai.api_server
    import parse_args; print(server_markdown(parse_args([])[0]), end='')" > docs/server-flags.md

tests/test_docs.py fails when a page and the code disagree, and when the source reads an
environment variable that ENV_VARS does not list.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from config.flags import _ENGINE_FLAGS, NO_FLAG_FIELDS, _bool, parse_dtype, parse_memory
from config.engine_config import CPU_DEVICE_MEMORY, EngineConfig

# What a default of None means, where it is not "off".
AUTO_DEFAULTS = {
    "device_memory": f"measured on GPU; on CPU the host's available memory less a margin ({CPU_DEVICE_MEMORY >> 30} "
                     "GiB where it cannot be read)",
    "kv_cache_memory_bytes": "from the memory plan",
    "num_kv_blocks": "from the memory plan",
    "quantize_lm_head": "auto",
    "gguf_blocks": "auto",
    "gguf_tiles": "auto",
    "scan_layers": "auto",
    "async_scheduling": "auto",
    "quantization": "none",
    "speculative_config": "none",
    "static_batch_size": "max_num_seqs",
    "memory_limit": "measured on GPU; none on CPU",
}
# EngineConfig fields with no flag: what they are (LLM(...) keyword arguments only).
NO_FLAG_MEANING = {
    "static_batch_size": "static batching: sequences per batch",
    "memory_limit": "bytes the allocator can still give (JAX's preallocation fraction minus what is held)",
    "reserve_bytes": "memory the plan keeps free beside weights, activations and the KV cache",
}


def _type(kw: dict) -> str:
    if kw.get("choices"):
        return " \\| ".join(str(c).lower() if c is not None else "none" for c in kw["choices"])
    kind = kw.get("type")
    return {int: "int", float: "float", _bool: "bool", parse_memory: "size", parse_dtype: "dtype"}.get(kind, "string")


def _default(name: str) -> str:
    value = EngineConfig.__dataclass_fields__[name].default
    if value is None or name in ("static_batch_size",):
        return AUTO_DEFAULTS.get(name, "none")
    if isinstance(value, bool):
        return str(value).lower()
    if name == "reserve_bytes":
        return f"{value >> 20} MiB"
    return str(value)


def markdown() -> str:
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    lines = [
        "# Configuration reference",
        "",
        "After reading this page you can set every engine argument: its flag, type, default, what it does,",
        "and the vLLM flag it stands for. The same names are keyword arguments of `LLM(...)` (the field",
        "column) and flags of `jaxserve serve`, `compile` and `bench` (`dump` takes those that shape the IR",
        "and the memory plan). vLLM's underscore spellings (`--max_model_len`) are accepted too.",
        "",
        "Generated from the flag table (`config/flags.py`) and `EngineConfig` (`config/engine_config.py`) by",
        "`python -m config.doc > docs/configuration.md`; `tests/test_docs.py` fails when they disagree.",
        "What each setting costs and buys, with measurements, is in the guides: [cpu.md](cpu.md),",
        "[gpu.md](gpu.md), [scaling.md](scaling.md), [compiler.md](compiler.md); the server's own flags",
        "(address, key, limits, timeouts, several processes, replicas) and the environment variables are",
        "on [server-flags.md](server-flags.md).",
        "",
        "Units: a size is `80` (a bare number is GiB), `80G`, `80GiB` or `512MiB`; a dtype is `auto`,",
        "`float32`, `bfloat16` or `float16` (or `f32`, `fp32`, `bf16`, `f16`, `half`); a bool is",
        "`true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`).",
        "",
        "| field | flag | type | default | meaning | vLLM |",
        "|---|---|---|---|---|---|",
    ]
    for name, flags, kw, vllm in _ENGINE_FLAGS:
        assert name in fields, name
        flag = ", ".join(f"`{f}`" for f in flags)
        meaning = kw.get("help", "").replace("|", "\\|")
        lines.append(f"| `{name}` | {flag} | {_type(kw)} | {_default(name)} | {meaning} | {vllm} |")
    lines += ["", "Fields with no flag (`LLM(...)` and saved plans only):", "",
              "| field | default | meaning |", "|---|---|---|"]
    for name in NO_FLAG_FIELDS:
        lines.append(f"| `{name}` | {_default(name)} | {NO_FLAG_MEANING[name]} |")
    return "\n".join(lines) + "\n"



# ---------------------------------------------------------------------------------- server flags

SERVER_PAGE_COMMAND = ("python -c \"from config.doc import server_markdown; from runtime.entrypoints.openai.api_server "
                       "import parse_args; print(server_markdown(parse_args([])[0]), end='')\" > docs/server-flags.md")
# What a server flag with no help string means, and defaults that are not the parser's value.
SERVER_FLAG_MEANING = {
    "--host": "the address the server listens on (0.0.0.0: every interface)",
    "--port": "the port the server listens on",
    "--log-level": "the server's log level",
}
SERVER_DEFAULTS = {
    "--api-key": "$JAXSERVE_API_KEY, else none (no key asked)",
    "--model": "smollm2-135m (when --plan is not given)",
    "--replica-log-dir": "none: this process's stderr",
}


def _server_default(action: argparse.Action) -> str:
    flag = action.option_strings[0]
    if flag in SERVER_DEFAULTS:
        return SERVER_DEFAULTS[flag]
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    return "none" if action.default is None else str(action.default)


def server_markdown(parser: argparse.ArgumentParser) -> str:
    """docs/server-flags.md: the flags of `parser` (the server's) that are not engine flags, by
    group, and the environment variables of ENV_VARS."""
    engine = {dest for dest, *_ in _ENGINE_FLAGS}
    lines = [
        "# Server flags and environment variables",
        "",
        "After reading this page you can set every flag of `jaxserve serve` (`python -m runtime.serve`) that",
        "is not an engine argument: the model or plan, the address and key, the limits and timeouts, one",
        "engine over several processes, and replicas behind a front; and every environment variable the",
        "engine, its commands, its scripts and its tests read. The engine arguments are on",
        "[configuration.md](configuration.md); what each server setting does in practice is in",
        "[serving.md](serving.md) and [scaling.md](scaling.md).",
        "",
        "Generated by `config/doc.py` from the server's own parser and its table of environment variables;",
        "`tests/test_docs.py` fails when this page and the code disagree, or when the source reads a variable",
        "the table does not list. To write it again:",
        "",
        "```",
        SERVER_PAGE_COMMAND,
        "```",
    ]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.option_strings and a.dest not in engine and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = "the server" if group.title in ("options", "optional arguments") else group.title
        lines += ["", f"## Flags: {title}", "", "| flag | default | meaning |", "|---|---|---|"]
        for a in actions:
            flag = ", ".join(f"`{f}`" for f in a.option_strings)
            meaning = a.help or SERVER_FLAG_MEANING.get(a.option_strings[0])
            assert meaning, f"{a.option_strings[0]} has no help and no SERVER_FLAG_MEANING"
            if a.choices:
                meaning += " (" + ", ".join(map(str, a.choices)) + ")"
            lines.append(f"| {flag} | {_server_default(a)} | {meaning.replace('|', chr(92) + '|')} |")
    lines += ["", "## Environment variables", ""]
    for group, rows in ENV_VARS:
        lines += [f"**{group}**", "", "| variable | default | meaning |", "|---|---|---|"]
        lines += [f"| `{name}` | {default} | {meaning} |" for name, default, meaning in rows]
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------ environment variables

# Every environment variable the project reads, by who reads it: (name, default, meaning).
# tests/test_docs.py scans the source for reads and fails on one that is missing here.
ENV_VARS = (
    ("The engine and the `jaxserve` commands", (
        ("JAXSERVE_API_KEY", "unset: no key", "the server's API key when `--api-key` is not given; "
         "`--data-parallel-size` hands the key to its replicas in it, never on a command line"),
        ("JAXSERVE_DIST_SECRET", "unset", "the secret every rank of a multi-process engine proves it knows, "
         "when `--dist-secret` is not given (set but empty: an error); else the file "
         "`$XDG_STATE_HOME/jaxserve/dist-secret` ([scaling.md](scaling.md))"),
        ("JAXSERVE_CPU_TARGET", "`native`", "the CPU class our C++ kernels are built for: `native`, `x86-64-v3`, "
         "`x86-64-v4`, `x86-64-v4-amx` or `none` ([cpu.md](cpu.md#cpu-classes-and-the-kernels-target-jaxserve_cpu_target))"),
        ("JAXSERVE_CPU_POLL_US", "300", "how long the kernels' helper threads poll for the next call, in "
         "microseconds, 0 to 1,000,000 (0: they sleep after every call)"),
        ("JAXSERVE_KERNEL_CACHE", "`~/.cache/jaxserve/kernels`", "where the C++ kernels' builds are kept"),
        ("JAXSERVE_GGUF_CACHE", "`~/.cache/jaxserve/gguf`", "where GGUF header indexes are kept; `none`, `off`, "
         "`0` or empty: not kept"),
        ("JAXSERVE_EXECUTABLE_STORE", "on", "`0`, `false`, `no` or `off`: no store of whole compiled steps "
         "(the warm start then traces every bucket)"),
        ("JAXSERVE_EXECUTABLE_STORE_MAX_GB", "4", "the executable store's size; the least recently used "
         "entries go first"),
        ("VLLM_CPU_KVCACHE_SPACE", "unset", "vLLM's CPU KV space: on a CPU, the KV cache's size in GiB (an "
         "integer), shared by the process's tensor-parallel devices; `0`: the memory plan's (what `--max-num-seqs` "
         "x `--max-model-len` use, within the budget); `--kv-cache-memory` and `--num-kv-blocks` win"),
        ("JAXSERVE_DEBUG", "off", "`1`, `true`, `yes` or `on`: an error prints its traceback, as `--debug` does"),
        ("JAXSERVE_PROG", "unset", "set by `jaxserve` and `scripts/serve.sh` for the command they run, so that "
         "its errors name the command as typed; not for users"),
        ("XDG_CACHE_HOME", "`~/.cache`", "the caches live in `$XDG_CACHE_HOME/jaxserve` (an absolute path; "
         "[serving.md](serving.md#where-the-caches-live))"),
        ("XDG_STATE_HOME", "`~/.local/state`", "the multi-process secret's file and the replicas' log "
         "directories live in `$XDG_STATE_HOME/jaxserve`"),
        ("CXX", "`g++`, else `c++`", "the compiler that builds the C++ kernels"),
        ("CUDA_VISIBLE_DEVICES", "all", "with `--data-parallel-size` on GPUs, the devices the replicas share out"),
        ("PYTHONPATH", "unset", "`jaxserve selfcheck` puts the checkout before it for its child processes"),
    )),
    ("JAX's own, as the engine reads them", (
        ("XLA_FLAGS", "unset", "`--xla_force_host_platform_device_count=N` gives a CPU N devices for "
         "`--tensor-parallel-size N`; part of a compiled step's key in the executable store"),
        ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75", "the share of a GPU that JAX preallocates, which caps the "
         "memory plan; the engine divides JAX's limit by it to find the GPU's size ([gpu.md](gpu.md#memory-fractions))"),
        ("XLA_PYTHON_CLIENT_PREALLOCATE", "true", "`false` or `0`: JAX does not preallocate, and the engine takes "
         "JAX's limit as the GPU's size"),
        ("XLA_PYTHON_CLIENT_ALLOCATOR", "unset", "`platform`: JAX allocates on demand, and the engine takes JAX's "
         "limit as the GPU's size"),
    )),
    ("The scripts", (
        ("JAXSERVE_REINSTALL", "unset", "`scripts/bootstrap.sh` (and so `serve.sh`, `test.sh`): any value but "
         "empty runs pip again"),
        ("PYTHON", "`python3`", "`scripts/bootstrap.sh`: the interpreter that makes `.venv`"),
        ("JAXSERVE_TEST_WORKERS", "2", "`scripts/test.sh`: pytest's processes (`-n`)"),
    )),
    ("The tests", (
        ("GOLDEN_DIR", "`tests/data/golden`", "another copy of HF transformers' golden outputs "
         "([its README](../tests/data/golden/README.md))"),
        ("JAXSERVE_TEST_CACHE", "`~/.cache/jaxserve-tests/xla`", "the tests' JAX compilation cache"),
        ("JAXSERVE_LONG_TESTS", "unset", "`1`: run `tests/test_multihost.py`'s long tests too"),
        ("JAX_PLATFORMS", "`cpu` in the tests", "JAX's platforms; `tests/conftest.py` sets `cpu` unless given"),
    )),
)


if __name__ == "__main__":
    sys.stdout.write(markdown())