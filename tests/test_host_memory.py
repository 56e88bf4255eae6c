"""The CPU budget read from the host (config.host_memory): MemAvailable, the cgroup's room at every
level, the margin, VLLM_CPU_KVCACHE_SPACE; made-up /proc and /sys/fs/cgroup trees, no OS mocking."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.host_memory import (GiB, HOST_MEMORY_MARGIN, available_host_memory, cgroup_memory_files, cgroup_room,
                                cpu_kv_cache_space, host_memory_budget, mem_available, read_host_memory)

MEMINFO = """MemTotal:       24683772 kB
MemFree:         1234567 kB
MemAvailable:   20971520 kB
Buffers:          123456 kB
"""
V2_CGROUP = "0::/user.slice/serve.scope\n"
V1_CGROUP = "9:name=systemd:/\n4:memory:/box/job\n3:cpuset:/\n0::/\n"


def fake_host(tmp_path: Path, meminfo: str = MEMINFO, proc_cgroup: str = V2_CGROUP,
              cgroups: dict[str, tuple[str, str]] | None = None) -> tuple[Path, Path]:
    """(proc, cgroup root): /proc/meminfo, /proc/self/cgroup, and (limit, usage) files per directory."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(meminfo)
    (proc / "self" / "cgroup").write_text(proc_cgroup)
    for rel, (limit, usage) in (cgroups or {}).items():
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes") if rel.startswith("memory") else \
            ("memory.max", "memory.current")
        (d / names[0]).write_text(limit + "\n")
        (d / names[1]).write_text(usage + "\n")
    return proc, root


def test_mem_available_reads_kib():
    assert mem_available(MEMINFO) == 20 * GiB
    assert mem_available("MemTotal: 100 kB\n") is None


def test_cgroup_room_is_limit_less_usage_and_none_without_a_limit():
    assert cgroup_room(str(8 * GiB), str(3 * GiB)) == 5 * GiB
    assert cgroup_room("max", "123") is None
    assert cgroup_room("9223372036854771712", "0") is None  # v1's "no limit"
    assert cgroup_room(str(GiB), str(2 * GiB)) == 0  # over its limit: nothing left


def test_the_least_of_meminfo_and_every_cgroup_level(tmp_path):
    """A limit on the parent binds a child with none of its own; the tightest level wins."""
    proc, root = fake_host(tmp_path, cgroups={
        "user.slice/serve.scope": ("max", str(GiB)),
        "user.slice": (str(12 * GiB), str(4 * GiB)),  # 8 GiB of room: below MemAvailable's 20
        "": ("max", "0")})
    pairs = cgroup_memory_files(V2_CGROUP, root)
    assert [p[0].parent for p in pairs] == [root / "user.slice/serve.scope", root / "user.slice", root]
    assert read_host_memory(proc, root) == host_memory_budget(8 * GiB) == 7 * GiB


def test_cgroup_v1_memory_controller(tmp_path):
    proc, root = fake_host(tmp_path, proc_cgroup=V1_CGROUP, cgroups={
        "memory/box/job": (str(6 * GiB), str(2 * GiB)), "memory/box": ("9223372036854771712", "0")})
    assert read_host_memory(proc, root) == 3 * GiB  # 4 GiB of room, less the 1 GiB margin


def test_no_cgroup_files_means_meminfo_alone(tmp_path):
    proc, root = fake_host(tmp_path, proc_cgroup="0::/not/mounted\n")
    assert read_host_memory(proc, root) == 20 * GiB - HOST_MEMORY_MARGIN


def test_not_linux_is_none(tmp_path):
    assert read_host_memory(tmp_path / "no-proc", tmp_path) is None
    assert available_host_memory(None, [None]) is None
    assert available_host_memory(None, [5 * GiB]) == 5 * GiB


def test_the_margin_is_at_most_a_quarter():
    assert host_memory_budget(16 * GiB) == 15 * GiB
    assert host_memory_budget(2 * GiB) == int(1.5 * GiB)


def test_vllm_cpu_kvcache_space():
    assert cpu_kv_cache_space({}) is None
    assert cpu_kv_cache_space({"VLLM_CPU_KVCACHE_SPACE": "0"}) is None  # vLLM's "default"
    assert cpu_kv_cache_space({"VLLM_CPU_KVCACHE_SPACE": " 3 "}) == 3 * GiB
    for bad in ("2GiB", "1.5", "-1"):
        with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
            cpu_kv_cache_space({"VLLM_CPU_KVCACHE_SPACE": bad})
