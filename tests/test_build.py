"""runtime.engine.build: the one compilation-cache rule every entry point shares."""

from pathlib import Path

import jax

from runtime.engine.build import compilation_cache_dir, default_compilation_cache


class _Plan:
    def __init__(self, directory=None):
        self.directory = directory


def test_explicit_dir_wins_and_none_turns_the_cache_off(tmp_path):
    assert compilation_cache_dir(_Plan("/plans/x"), tmp_path / "c") == tmp_path / "c"
    assert compilation_cache_dir(_Plan("/plans/x"), "~/c") == Path("~/c").expanduser()
    for off in ("none", ""):
        assert compilation_cache_dir(_Plan("/plans/x"), off) is None


def test_a_plan_directory_keeps_its_own_cache():
    assert compilation_cache_dir(_Plan("/plans/x")) == Path("/plans/x") / "xla_cache"


def test_in_memory_plans_share_the_per_user_cache_unless_one_is_set():
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert compilation_cache_dir(_Plan()) == default_compilation_cache()
        jax.config.update("jax_compilation_cache_dir", "/tmp/session-cache")
        assert compilation_cache_dir(_Plan()) is None  # keep what this process already chose
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_every_per_user_cache_honours_xdg_cache_home(tmp_path, monkeypatch):
    """The kernel builds, the XLA cache of in-memory plans and the GGUF index all follow
    XDG_CACHE_HOME (models.user_cache), and each cache's own variable still wins."""
    from models.weights import gguf_cache_dir
    from runtime.worker import cpp_kernels

    for env in ("JAXSERVE_KERNEL_CACHE", "JAXSERVE_GGUF_CACHE"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpp_kernels.cache_dir() == tmp_path / "xdg" / "jaxserve" / "kernels"
    assert default_compilation_cache() == tmp_path / "xdg" / "jaxserve" / "xla"
    assert gguf_cache_dir() == tmp_path / "xdg" / "jaxserve" / "gguf"
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path / "k"))
    monkeypatch.setenv("JAXSERVE_GGUF_CACHE", "none")
    assert cpp_kernels.cache_dir() == tmp_path / "k"
    assert gguf_cache_dir() is None
    # Unset, empty or relative: ignored, as the XDG base-directory rule says.
    for value in (None, "", "relative/cache"):
        if value is None:
            monkeypatch.delenv("XDG_CACHE_HOME")
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", value)
        assert default_compilation_cache() == Path.home() / ".cache" / "jaxserve" / "xla"
