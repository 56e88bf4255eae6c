"""The memory a CPU engine plans for: what the host has available when it starts.

On a CPU the "device" is the host's RAM, shared with every other process. The plan's budget is what
is available at start: /proc/meminfo's MemAvailable, or the room left under the process's cgroup
memory limit (v2 memory.max, v1 memory.limit_in_bytes, at every level up to the root) where that
is lower, less HOST_MEMORY_MARGIN for what the plan does not count (the Python process, JAX and
XLA's compiler, the tokenizer, the HTTP server). Where neither can be read (not Linux), the plan
falls back to config.engine_config.CPU_DEVICE_MEMORY.

The readers take the files' text, so that tests feed them made-up hosts; `read_host_memory` is
the one place that opens the files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

GiB = 1 << 30
# What the process needs beyond the plan's weights, activations and KV cache, and slack for other
# processes' growth: SmolLM2's f32 server held 4,712 MiB at /health beside a 3,621 MiB plan
# (runtime/worker/model_runner.py). Never more than a quarter of what is available, so a small
# host still plans for most of its memory.
HOST_MEMORY_MARGIN = 1 * GiB
# A cgroup limit at or above this is "no limit" (v1 writes 2^63 rounded down to a page).
_NO_LIMIT = 1 << 60
# vLLM's CPU backend: the KV cache's space in GiB (an integer; 0 or unset: the engine's default).
CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def mem_available(meminfo_text: str) -> int | None:
    """Bytes of MemAvailable in /proc/meminfo's text (None if absent)."""
    for line in meminfo_text.splitlines():
        key, _, rest = line.partition(":")
        if key.strip() == "MemAvailable":
            value, *unit = rest.split()
            return int(value) * (1024 if unit and unit[0].lower() == "kb" else 1)
    return None


def cgroup_room(limit_text: str, usage_text: str) -> int | None:
    """Bytes a cgroup can still charge: its limit less its usage (None: no limit)."""
    limit = limit_text.strip()
    if limit in ("", "max") or int(limit) >= _NO_LIMIT:
        return None
    return max(int(limit) - int(usage_text.strip() or 0), 0)


# (controller directory under the cgroup mount, limit file, usage file): v2's unified tree, v1's memory tree.
_CGROUP_FILES = {"v2": ("", "memory.max", "memory.current"),
                 "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes")}


def cgroup_memory_files(proc_cgroup_text: str, root: str | os.PathLike = "/sys/fs/cgroup") -> list[tuple[Path, Path]]:
    """(limit, usage) file pairs that bound this process, from its own cgroup up to the root, read
    from /proc/self/cgroup's text: the v2 line `0::/path` and a v1 line whose controllers include
    `memory`. Only the pairs whose files exist."""
    pairs = []
    for line in proc_cgroup_text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        kind = "v2" if hierarchy == "0" and controllers == "" else "v1" if "memory" in controllers.split(",") else None
        if kind is None:
            continue
        sub, limit_name, usage_name = _CGROUP_FILES[kind]
        base = Path(root) / sub if sub else Path(root)
        rel = Path(path.lstrip("/"))
        for d in [base / rel] + [base / p for p in rel.parents]:
            if (d / limit_name).is_file() and (d / usage_name).is_file():
                pairs.append((d / limit_name, d / usage_name))
    return pairs


def available_host_memory(meminfo_text: str | None, cgroup_rooms: Iterable[int | None] = ()) -> int | None:
    """The least of MemAvailable and every cgroup's room (None when none of them is known)."""
    known = [b for b in [mem_available(meminfo_text) if meminfo_text else None, *cgroup_rooms] if b is not None]
    return min(known) if known else None


def host_memory_budget(available: int) -> int:
    """What a plan may count on out of `available` bytes: less HOST_MEMORY_MARGIN (at most a quarter)."""
    return available - min(HOST_MEMORY_MARGIN, available // 4)


def read_host_memory(proc: str | os.PathLike = "/proc", cgroup_root: str | os.PathLike = "/sys/fs/cgroup") -> int | None:
    """The host memory this process may plan for now (host_memory_budget of available_host_memory),
    or None where /proc/meminfo does not exist (not Linux)."""
    try:
        meminfo = (Path(proc) / "meminfo").read_text()
    except OSError:
        return None
    rooms = []
    try:
        for limit, usage in cgroup_memory_files((Path(proc) / "self" / "cgroup").read_text(), cgroup_root):
            rooms.append(cgroup_room(limit.read_text(), usage.read_text()))
    except (OSError, ValueError):  # no cgroup file, or one we cannot parse: MemAvailable alone
        pass
    available = available_host_memory(meminfo, rooms)
    return None if available is None else host_memory_budget(available)


def cpu_kv_cache_space(environ: Mapping[str, str] = os.environ) -> int | None:
    """Bytes of VLLM_CPU_KVCACHE_SPACE (GiB, an integer; None when unset or 0, vLLM's "default")."""
    text = environ.get(CPU_KV_SPACE_ENV, "").strip()
    if not text:
        return None
    try:
        gib = int(text)
    except ValueError:
        raise ValueError(f"{CPU_KV_SPACE_ENV}={text!r}: give the CPU KV cache's space in GiB, an integer "
                         f"(e.g. {CPU_KV_SPACE_ENV}=4)") from None
    if gib < 0:
        raise ValueError(f"{CPU_KV_SPACE_ENV}={text!r}: GiB must be 0 (the default) or more")
    return gib * GiB or None
