"""Where jaxserve keeps its per-user caches, by one rule for all of them: the C++ kernel builds
(`kernels`), JAX's compilation cache and the executable store of in-memory plans (`xla`), and the
GGUF header index (`gguf`).

They live in `$XDG_CACHE_HOME/jaxserve/<name>`, or `~/.cache/jaxserve/<name>` where XDG_CACHE_HOME
is unset, empty or relative (the XDG base-directory rule: a relative path is ignored). A cache's
own variable (JAXSERVE_KERNEL_CACHE, JAXSERVE_GGUF_CACHE) still names its directory outright.
"""

from __future__ import annotations

import os
from pathlib import Path

XDG_CACHE_HOME = "XDG_CACHE_HOME"


def cache_home() -> Path:
    """$XDG_CACHE_HOME/jaxserve, else ~/.cache/jaxserve."""
    xdg = os.environ.get(XDG_CACHE_HOME, "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "jaxserve"


def user_cache_dir(name: str, override_env: str | None = None) -> Path:
    """The directory of the cache `name`: `$override_env` where that is set and not empty, else
    cache_home() / name. Read at each call, so a change to the environment counts."""
    override = os.environ.get(override_env, "") if override_env else ""
    return Path(override).expanduser() if override.strip() else cache_home() / name
