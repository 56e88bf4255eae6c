"""The executable store (runtime/worker/executables.py): a warm start loads every step whole,
without tracing; a different program never loads another's executable; a bad entry costs a
compile, never a start."""

from __future__ import annotations

import logging
import os
import time

import jax
import numpy as np
import pytest

from models.config import get_preset
from models.weights import random_weights
from runtime.build import build_runner
from runtime.config import EngineConfig
from runtime.plan import compile_plan
from runtime.worker import executables
from runtime.worker.model_runner import ModelRunner

# A KV pool size of this process's own: the session's persistent compilation cache (conftest) must
# not hold these programs yet, since the store keeps only what XLA compiles in front of it.
BLOCKS = 40 + (os.getpid() * 7919 + time.time_ns() // 10**6) % 4000
ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=BLOCKS)


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


def test_a_warm_runner_loads_every_executable_without_tracing(tmp_path, monkeypatch):
    plan = tiny_plan()
    cold = ModelRunner(plan, executables=tmp_path)
    cold.warmup()
    n = len(plan.buckets.pairs()) + 2  # every bucket's step, the block copy, prompt logprobs
    assert (cold.executables.hits, cold.executables.misses) == (0, n)
    assert len(list(tmp_path.glob("*.bin"))) == n and not list(tmp_path.glob("*.tmp"))
    bucket = plan.buckets.pairs()[0]
    want = step_tokens(cold, bucket)
    del cold

    jax.clear_caches()
    warm = ModelRunner(plan, executables=tmp_path)
    never_traced(monkeypatch, warm)
    warm.warmup()
    assert (warm.executables.hits, warm.executables.misses) == (n, 0)
    got = step_tokens(warm, bucket)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    # loaded again in the same process (a second LLM): it still runs
    again = ModelRunner(plan, executables=tmp_path)
    again.compile_bucket(bucket)
    assert again.executables.hits == 1
    np.testing.assert_array_equal(step_tokens(again, bucket)[1], want[1])



class NoCompiles:
    """A thread's compile count that never moves."""
    compiles = property(lambda self: 0, lambda self, value: None)


def test_an_executable_that_xla_did_not_compile_is_not_stored(tmp_path, monkeypatch):
    """What JAX's persistent cache serves (no backend compile) would serialize without its code on
    XLA:CPU, and fail when run from the store ("Function ... not found"): it is never stored."""
    plan = tiny_plan(max_model_len=32)
    monkeypatch.setattr(executables, "_this_thread", NoCompiles())  # as if every compile were a cache hit
    runner = ModelRunner(plan, executables=tmp_path)
    runner.compile_bucket(plan.buckets.pairs()[0])
    assert (runner.executables.hits, runner.executables.misses, runner.executables.uncompiled) == (0, 1, 1)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_another_program_or_shape_never_loads_a_stored_executable(tmp_path):
    plan = tiny_plan()
    ModelRunner(plan, executables=tmp_path).warmup()
    for other in (tiny_plan(num_kv_blocks=BLOCKS + 1),  # KV pool shapes
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


def test_an_unreadable_entry_is_compiled_again_and_replaced(tmp_path, caplog):
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
    assert ModelRunner(plan, executables=tmp_path).executables.load("step", *runner._step_args(bucket)) is not None


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
