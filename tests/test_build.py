"""runtime.build: the one compilation-cache rule every entry point shares."""

from pathlib import Path

import jax

from runtime.build import DEFAULT_COMPILATION_CACHE, compilation_cache_dir


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
        assert compilation_cache_dir(_Plan()) == DEFAULT_COMPILATION_CACHE
        jax.config.update("jax_compilation_cache_dir", "/tmp/session-cache")
        assert compilation_cache_dir(_Plan()) is None  # keep what this process already chose
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
