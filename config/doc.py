"""docs/configuration.md, generated from the one flag table (config.flags._ENGINE_FLAGS) and
EngineConfig's fields and defaults: a flag's name, type, default, meaning and vLLM equivalent.

    python -m config.doc > docs/configuration.md

tests/test_docs.py fails when the page and the table disagree.
"""

from __future__ import annotations

import dataclasses
import sys

from config.flags import _ENGINE_FLAGS, NO_FLAG_FIELDS, _bool, parse_dtype, parse_memory
from config.engine_config import CPU_DEVICE_MEMORY, EngineConfig

# What a default of None means, where it is not "off".
AUTO_DEFAULTS = {
    "device_memory": f"measured on GPU; {CPU_DEVICE_MEMORY >> 30} GiB per process on CPU",
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
        "(limits, timeouts, keys) are in [serving.md](serving.md).",
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


if __name__ == "__main__":
    sys.stdout.write(markdown())
