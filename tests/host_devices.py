"""For test files that run their multi-device checks in a child process (`python tests/test_x.py
CASE`): the child asks XLA for host devices before anything imports jax, and finds the repository's
modules and the tests' helpers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def become_child(devices: int = 4) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
