"""The executable store (runtime/worker/executables.py): a warm start loads every step whole,
without tracing; a different program never loads another's executable; a bad entry costs a
compile, never a start."""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from models.config import get_preset
from models.weights import random_weights
from runtime.engine.build import build_runner
from config.engine_config import EngineConfig
from runtime.engine.plan import compile_plan
from runtime.worker import executables
from runtime.worker.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[1]
ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=48)


@pytest.fixture(autouse=True)
def own_compilation_cache(tmp_path_factory):
    """A JAX persistent cache of each test's own, empty: the store keeps only what XLA compiles in
    front of it, so what the session's cache (conftest) already holds would never be stored."""
    session_dir = jax.config.jax_compilation_cache_dir
    empty_jax_cache(tmp_path_factory.mktemp("xla"))
    yield
    compilation_cache.set_cache_dir(session_dir)
    compilation_cache.reset_cache()


def empty_jax_cache(directory) -> None:
    """JAX's persistent cache moved to `directory`, and nothing compiled kept in memory."""
    compilation_cache.set_cache_dir(str(directory))
    compilation_cache.reset_cache()
    jax.clear_caches()


def tiny_plan(**engine):
    cfg = get_preset("tiny")
    return compile_plan(None, EngineConfig(**(ENGINE | engine)), weights=random_weights(cfg, seed=3), config=cfg)


def decode_inputs(runner, bucket):
    a = {k: np.zeros(v.shape, v.dtype) for k, v in runner.input_specs(*bucket).items()}
    a["tokens"][:1], a["positions"][:1], a["slot_mapping"][:] = 7, 0, -1
    a["slot_mapping"][0], a["context_lens"][0], a["cu_q_lens"][1:] = 0, 1, 1
    return a


def step_tokens(runner, bucket):
    out = runner.execute(bucket, decode_inputs(runner, bucket))
    return np.asarray(out["tokens"]), np.asarray(out["logits"])


class NeverLowered:
    def __init__(self, name):
        self.name = name

    def lower(self, *args, **kwargs):
        pytest.fail(f"{self.name} was traced")


def never_traced(monkeypatch, runner):
    """Fails the test if `runner` lowers (traces) anything from here on."""
    for name in ("_step", "_multi_step", "_copy", "_head_logprobs"):
        monkeypatch.setattr(runner, name, NeverLowered(name))


@pytest.mark.slow
def test_a_warm_runner_loads_every_executable_without_tracing(tmp_path, monkeypatch, capsys):
    plan = tiny_plan()
    cold = ModelRunner(plan, executables=tmp_path)
    cold.warmup(progress=True)
    assert "compile buckets: 100%" in capsys.readouterr().err
    n = len(plan.buckets.pairs()) + 2  # every bucket's step, the block copy, prompt logprobs
    assert (cold.executables.hits, cold.executables.misses) == (0, n)
    assert len(list(tmp_path.glob("*.bin"))) == n and not list(tmp_path.glob("*.tmp"))
    bucket = plan.buckets.pairs()[0]
    want = step_tokens(cold, bucket)
    del cold

    jax.clear_caches()
    warm = ModelRunner(plan, executables=tmp_path)
    never_traced(monkeypatch, warm)
    warm.warmup(progress=True)
    assert (warm.executables.hits, warm.executables.misses) == (n, 0)
    bar = capsys.readouterr().err
    assert "load buckets: 100%" in bar and "compile" not in bar  # a warm start only loads
    got = step_tokens(warm, bucket)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    # loaded again in the same process (a second LLM): it still runs
    again = ModelRunner(plan, executables=tmp_path)
    again.compile_bucket(bucket)
    assert again.executables.hits == 1
    np.testing.assert_array_equal(step_tokens(again, bucket)[1], want[1])


def test_the_bar_says_how_many_buckets_were_loaded():
    from runtime.worker.model_runner import bar_label

    assert bar_label("compile buckets", 0, 8) == "compile buckets"
    assert bar_label("compile buckets", 3, 8) == "compile buckets (3 of 8 loaded)"
    assert bar_label("compile buckets for the resized KV pool", 8, 8) == "load buckets for the resized KV pool"


def test_an_executable_that_xla_did_not_compile_is_not_stored(tmp_path):
    """What JAX's persistent cache serves serializes without its code on XLA:CPU, and fails when run
    from the store ("Function ... not found"). A trace that compiles something small of its own
    (an eager op, evaluated at trace time) must not make a cache-served step look compiled."""
    sizes = itertools.count(1)

    def f(x):
        with jax.ensure_compile_time_eval():
            zero = float(jax.numpy.zeros(next(sizes)).sum())  # a fresh backend compile, on this thread
        return jax.numpy.tanh(x @ x.T) * 3 + zero

    x = jax.ShapeDtypeStruct((24, 16), np.float32)
    jax.jit(f).lower(x).compile()  # into the test's persistent cache
    jax.clear_caches()
    store = executables.ExecutableStore(tmp_path, jax.devices()[0], "k")
    compiled = store.compile("f", jax.jit(f), x)
    assert (store.hits, store.misses, store.uncompiled) == (0, 1, 1)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())
    ones = np.ones(x.shape, np.float32)
    np.testing.assert_allclose(np.asarray(compiled(ones)), np.tanh(ones @ ones.T) * 3, rtol=1e-6)


@pytest.mark.slow
def test_a_start_that_jax_cache_serves_stores_nothing_and_runs(tmp_path):
    """The server's case: a process whose JAX cache already holds every program (an earlier start
    without the store) stores nothing, and what it runs is right."""
    plan = tiny_plan()
    bucket = plan.buckets.pairs()[0]
    first = ModelRunner(plan)
    first.warmup()
    want = step_tokens(first, bucket)
    del first
    jax.clear_caches()
    runner = ModelRunner(plan, executables=tmp_path / "ex")
    runner.warmup()
    n = len(plan.buckets.pairs()) + 2
    assert (runner.executables.misses, runner.executables.uncompiled) == (n, n)
    assert not (tmp_path / "ex").exists()
    np.testing.assert_array_equal(step_tokens(runner, bucket)[1], want[1])


@pytest.mark.slow
def test_another_program_or_shape_never_loads_a_stored_executable(tmp_path):
    plan = tiny_plan()
    ModelRunner(plan, executables=tmp_path).warmup()
    for other in (tiny_plan(num_kv_blocks=plan.num_kv_blocks + 1),  # KV pool shapes
                  tiny_plan(max_num_seqs=4),  # buckets and sampler rows
                  tiny_plan(scan_layers=True)):  # another layout of the same model
        runner = ModelRunner(other, executables=tmp_path)
        runner.compile_bucket(other.buckets.pairs()[-1])
        assert (runner.executables.hits, runner.executables.misses) == (0, 1)
    # and a change to a traced source is another key for the same plan
    key = ModelRunner(plan, executables=tmp_path).executables.key("step", (jax.ShapeDtypeStruct((1,), np.int32),))
    monkeypatch = pytest.MonkeyPatch()
    try:
        executables.code_fingerprint.cache_clear()
        monkeypatch.setattr(executables, "TRACED_SOURCES", executables.TRACED_SOURCES[:-1])
        assert ModelRunner(plan, executables=tmp_path).executables.key("step", (jax.ShapeDtypeStruct((1,), np.int32),)) != key
    finally:
        monkeypatch.undo()
        executables.code_fingerprint.cache_clear()
    # and so is another build of the C++ kernels (JAXSERVE_CPU_TARGET): its steps call other kernels
    args = ("step", (jax.ShapeDtypeStruct((1,), np.int32),))
    keys = set()
    for target in ("native", "x86-64-v3", "none"):
        monkeypatch.setenv("JAXSERVE_CPU_TARGET", target)
        keys.add(executables.ExecutableStore(tmp_path, jax.devices()[0]).key(*args))
    monkeypatch.undo()
    assert len(keys) == 3


@pytest.mark.slow
def test_an_unreadable_entry_is_removed_and_replaced_by_the_next_compile(tmp_path, caplog):
    plan = tiny_plan()
    bucket = plan.buckets.pairs()[0]
    first = ModelRunner(plan, executables=tmp_path)
    first.compile_bucket(bucket)
    want = step_tokens(first, bucket)
    (entry,) = tmp_path.glob("step-*.bin")
    entry.write_bytes(b"not a pickle")
    runner = ModelRunner(plan, executables=tmp_path)
    with caplog.at_level(logging.WARNING, logger=executables.__name__):
        runner.compile_bucket(bucket)
    assert "unreadable" in caplog.text
    assert (runner.executables.hits, runner.executables.misses) == (0, 1)
    np.testing.assert_array_equal(step_tokens(runner, bucket)[0], want[0])
    assert not entry.exists()  # JAX's cache served that compile: nothing could replace it yet
    empty_jax_cache(tmp_path / "xla")
    ModelRunner(plan, executables=tmp_path).compile_bucket(bucket)  # compiled by XLA: stored
    again = ModelRunner(plan, executables=tmp_path)
    again.compile_bucket(bucket)
    assert again.executables.hits == 1
    np.testing.assert_array_equal(step_tokens(again, bucket)[0], want[0])


MULTI_DEVICE_CHILD = """
import sys
import time
import jax, numpy as np
sys.path.insert(0, {root!r})
from tests.test_executables import tiny_plan, step_tokens
from runtime.worker.model_runner import ModelRunner, enable_compilation_cache
enable_compilation_cache({xla!r})
assert len(jax.devices()) == 2
plan = tiny_plan()
bucket = plan.buckets.pairs()[0]
first = ModelRunner(plan, executables={store!r})
first.compile_bucket(bucket)
want = step_tokens(first, bucket)
jax.clear_caches()
again = ModelRunner(plan, executables={store!r})
again.compile_bucket(bucket)
assert again.executables.hits == 1, again.executables.hits
np.testing.assert_array_equal(step_tokens(again, bucket)[1], want[1])
print("ok")
"""


@pytest.mark.slow
def test_a_stored_executable_runs_where_the_host_has_several_devices(tmp_path):
    """A process with more devices than the runner uses (forced host devices, as for tensor
    parallelism on a CPU) loads a stored step onto the runner's device only."""
    code = MULTI_DEVICE_CHILD.format(root=str(ROOT), xla=str(tmp_path / "xla"), store=str(tmp_path / "ex"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_build_runner_keeps_a_store_only_in_a_cache_it_chooses(tmp_path, monkeypatch):
    plan = tiny_plan()
    # the session's compilation cache stays where conftest put it
    monkeypatch.setattr("runtime.worker.model_runner.enable_compilation_cache", lambda directory: None)
    assert build_runner(plan, tmp_path / "c").executables.directory == tmp_path / "c" / "executables"
    assert build_runner(plan, "none").executables is None
    monkeypatch.setenv(executables.ENV_SWITCH, "0")
    assert build_runner(plan, tmp_path / "c").executables is None
    monkeypatch.delenv(executables.ENV_SWITCH)
    # the test session chose its cache (conftest): its tests may patch what a trace sees
    assert jax.config.jax_compilation_cache_dir
    assert build_runner(plan).executables is None
    # `jaxserve compile`: the plan's store is backed by the per-user one that `serve --model` fills
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    store = build_runner(plan, tmp_path / "c", share_user_store=True).executables
    assert store.shared == tmp_path / "xdg" / "jaxserve" / "xla" / "executables"
    assert build_runner(plan, tmp_path / "c").executables.shared is None


@pytest.mark.slow
def test_a_warm_execute_runs_each_bucket_once_and_writes_no_kv(monkeypatch):
    runner = ModelRunner(tiny_plan())
    runner.warmup()
    step_tokens(runner, (1, 1))  # one token's K/V in slot 0: warming must keep it as it is
    before = {k: np.asarray(v).copy() for k, v in runner.state.items()}
    assert any(v.any() for v in before.values())
    runs = []
    real_execute = runner.execute
    monkeypatch.setattr(runner, "execute",
                        lambda bucket, *a, **kw: runs.append(bucket) or real_execute(bucket, *a, **kw))
    runner.warmup(execute=True)
    assert sorted(runs) == sorted(runner.plan.buckets.pairs())
    for k, v in runner.state.items():
        np.testing.assert_array_equal(np.asarray(v), before[k], err_msg=k)


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.slow
def test_the_servers_warm_execute_runs_buckets_only_where_first_runs_are_slow(monkeypatch, scan_layers):
    """execute="auto" (the server's): on CPU, a scanned step's buckets are not run at start (their
    first runs cost about what later ones do), an unrolled step's all are."""
    runner = ModelRunner(tiny_plan(scan_layers=scan_layers))
    assert (runner.layout.layers is not None) == scan_layers
    runs = []
    real_execute = runner.execute
    monkeypatch.setattr(runner, "execute",
                        lambda bucket, *a, **kw: runs.append(bucket) or real_execute(bucket, *a, **kw))
    runner.warmup(execute="auto")
    assert runner.first_runs_are_slow == (not scan_layers)
    assert sorted(runs) == ([] if scan_layers else sorted(runner.plan.buckets.pairs()))
    assert set(runner.compiled) == set(runner.plan.buckets.pairs())  # compiled (or loaded) either way


@pytest.mark.slow
def test_release_host_weights_drops_the_plans_copy_and_the_runner_still_runs():
    plan = tiny_plan()
    kept = ModelRunner(plan)
    assert plan.weights is not None  # by default the plan keeps them (tests, benchmarks, Plan.save)
    released = ModelRunner(plan, release_host_weights=True)
    assert plan.weights is None
    for k, v in kept.params.items():
        np.testing.assert_array_equal(np.asarray(released.params[k]), np.asarray(v), err_msg=k)
    kept.warmup()
    released.warmup()
    (tokens_a, logits_a), (tokens_b, logits_b) = step_tokens(kept, (1, 1)), step_tokens(released, (1, 1))
    np.testing.assert_array_equal(tokens_a, tokens_b)
    np.testing.assert_array_equal(logits_a, logits_b)


def test_the_store_is_bounded_and_evicts_what_was_used_least_recently(tmp_path):
    device = jax.devices()[0]
    store = executables.ExecutableStore(tmp_path, device, "bound")
    x = jax.ShapeDtypeStruct((8,), np.float32)
    fns = {name: jax.jit(lambda v, c=c: jax.numpy.sin(v) * c) for c, name in enumerate("abc", start=2)}

    def entry(name):
        return store._path(name, (x,))

    def stored(name):
        store.compile(name, fns[name], x)
        assert entry(name).exists()
        time.sleep(0.05)  # file times are kept at the kernel's tick: keep the uses apart

    stored("a")
    stored("b")
    assert store.load("a", x) is not None  # a use: "a" is now more recent than "b"
    time.sleep(0.05)
    sizes = {n: entry(n).stat().st_size for n in "ab"}
    store.max_bytes = sum(sizes.values()) + 64  # room for two entries of about that size, not three
    store.compile("c", fns["c"], x)
    assert entry("c").exists() and entry("a").exists() and not entry("b").exists()
    assert store.evicted == 1
    assert store.load("b", x) is None  # an evicted entry is a miss, not an error
    np.testing.assert_allclose(np.asarray(store.load("c", x)(np.ones(8, np.float32))), np.sin(1.0) * 4,
                               rtol=1e-6)


def test_a_store_backed_by_a_shared_one_loads_its_entries_and_keeps_copies(tmp_path):
    """`jaxserve compile` after `jaxserve serve --model` with the same flags: the plan directory's
    store finds what the per-user store holds (the key names no directory), keeps its own copy, and
    what it compiles itself goes to both (so a later serve loads it)."""
    device = jax.devices()[0]
    user, plan_a, plan_b = tmp_path / "user", tmp_path / "plan_a", tmp_path / "plan_b"
    x = jax.ShapeDtypeStruct((8,), np.float32)
    served = executables.ExecutableStore(user, device, "program")
    served.compile("step", jax.jit(lambda v: jax.numpy.sin(v) * 3), x)
    assert served.misses == 1 and len(list(user.glob("*.bin"))) == 1

    compiled = executables.ExecutableStore(plan_a, device, "program", shared=user)
    got = compiled.compile("step", NeverLowered("step"), x)  # found in the shared store: no trace
    assert (compiled.hits, compiled.shared_hits, compiled.misses) == (1, 1, 0)
    np.testing.assert_allclose(np.asarray(got(np.ones(8, np.float32))), np.sin(1.0) * 3, rtol=1e-6)
    assert sorted(p.name for p in plan_a.glob("*.bin")) == sorted(p.name for p in user.glob("*.bin"))
    # compiled here: kept in the plan directory and in the shared store
    compiled.compile("copy", jax.jit(lambda v: v + 1), x)
    assert compiled.misses == 1
    assert {p.name for p in plan_a.glob("*.bin")} == {p.name for p in user.glob("*.bin")}
    assert len(list(user.glob("*.bin"))) == 2 and not list(user.glob("*.tmp"))

    # the plan directory alone is enough: the shared store gone, its copies still load
    for p in user.glob("*.bin"):
        p.unlink()
    alone = executables.ExecutableStore(plan_a, device, "program")
    assert alone.load("step", x) is not None and alone.load("copy", x) is not None
    # another program never takes the shared store's entries
    other = executables.ExecutableStore(plan_b, device, "another program", shared=plan_a)
    assert other.load("step", x) is None and not plan_b.exists()


def test_the_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(executables.MAX_GB_ENV, "0.5")
    assert executables.max_bytes() == 2**29
    monkeypatch.setenv(executables.MAX_GB_ENV, "lots")
    assert executables.max_bytes() == int(executables.DEFAULT_MAX_GB * 2**30)
