"""The one place a plan becomes a running engine (plans come from runtime.engine.plan's `load_plan`):
`build_runner` (the device side, with the one compilation-cache rule) and `build_engine`.
`LLM`, the server, the benchmarks and `compile` all come through here."""

from __future__ import annotations

from pathlib import Path

from models.user_cache import user_cache_dir
from runtime.engine.plan import Plan

NO_CACHE = ("none", "")


def compilation_cache_dir(plan: Plan, cache_dir: str | Path | None = None) -> Path | None:
    """Where compiled executables persist: `cache_dir` if given ("none" turns the cache off), else the
    plan directory's xla_cache/, else the cache this process already uses, else one per-user cache
    shared by in-memory plans."""
    if cache_dir is not None:
        return None if str(cache_dir) in NO_CACHE else Path(cache_dir).expanduser()
    if plan.directory is not None:
        return Path(plan.directory) / "xla_cache"
    import jax

    if jax.config.jax_compilation_cache_dir:  # already chosen in this process (a test session, a user)
        return None
    return default_compilation_cache()


def default_compilation_cache() -> Path:
    """The per-user cache of in-memory plans: $XDG_CACHE_HOME/jaxserve/xla, else ~/.cache/jaxserve/xla."""
    return user_cache_dir("xla")


def build_runner(plan: Plan, cache_dir: str | Path | None = None, share_user_store: bool = False,
                 **runner_kwargs):
    """The ModelRunner for `plan` (weights and KV pools on the device), with the cache rule above.

    Where this rule picks the cache directory, the runner also keeps its executables whole in
    DIR/executables (runtime.worker.executables), so that a warm start neither compiles nor traces,
    unless JAXSERVE_EXECUTABLE_STORE=0. A cache this process chose before (a test session's, whose
    tests may patch what a trace sees) gets no store.

    `share_user_store` (`jaxserve compile`): that store is backed by the per-user one, which
    `serve --model` fills, so a compile after a serve of the same model and flags loads what the
    serve compiled (and a later serve loads what the compile compiled)."""
    from runtime.worker import executables
    from runtime.worker.model_runner import ModelRunner, enable_compilation_cache

    directory = compilation_cache_dir(plan, cache_dir)
    if directory is not None:
        enable_compilation_cache(directory)
        if executables.enabled():
            runner_kwargs.setdefault("executables", directory / "executables")
            if share_user_store:
                runner_kwargs.setdefault("shared_executables", default_compilation_cache() / "executables")
    return ModelRunner(plan, **runner_kwargs)


def build_engine(plan: Plan, *, cache_dir: str | Path | None = None, runner=None, tokenizer=None,
                 warmup: bool = True, progress: bool = False, warm_execute: bool | str = False,
                 check_invariants: bool = False, release_host_weights: bool = False):
    """The LLMEngine over `plan`: a new runner unless one is given (the benchmarks share one across
    engines), compiled (or loaded from the cache) unless `warmup=False`. `release_host_weights`
    goes to the new runner (ModelRunner); a given runner has already made that choice."""
    from runtime.engine.llm_engine import LLMEngine

    if runner is None:
        runner = build_runner(plan, cache_dir, release_host_weights=release_host_weights)
    return LLMEngine(plan, tokenizer, runner=runner, warmup=warmup, progress=progress,
                     warm_execute=warm_execute, check_invariants=check_invariants)
