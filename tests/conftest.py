"""Shared test setup: CPU JAX, a persistent compile cache, and one SmolLM2 engine per session."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The GGUF header index (models.weights) the tests write goes beside their compile cache, not the user's.
os.environ.setdefault("JAXSERVE_GGUF_CACHE", str(Path.home() / ".cache" / "jaxserve-tests" / "gguf"))
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# HF transformers' outputs the engine is held to (tests/data/golden/README.md); GOLDEN_DIR points
# the tests at another copy (set but empty: this one).
REPO_GOLDEN_DIR = ROOT / "tests" / "data" / "golden"
GOLDEN_DIR = Path(os.environ.get("GOLDEN_DIR") or REPO_GOLDEN_DIR)
# One compile cache for the whole run (and across runs on the same machine): each bucket of the
# real model is compiled once, not once per test module.
CACHE_DIR = Path(os.environ.get("JAXSERVE_TEST_CACHE", Path.home() / ".cache" / "jaxserve-tests" / "xla"))

# Engine shape used by every SmolLM2 test, so they share compiled buckets.
SMOL_ARGS = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=320)


def pytest_configure(config):
    if not (GOLDEN_DIR / "prompts.json").is_file():
        # Test modules read the golden prompts when they are collected; say what is missing once.
        raise pytest.UsageError(
            f"the tests need the golden outputs of HF transformers, and {GOLDEN_DIR} has none (no prompts.json). "
            f"The repository holds them in tests/data/golden, the default when GOLDEN_DIR is unset; "
            f"tests/data/make_golden.py remakes them.")
    from runtime.worker.model_runner import enable_compilation_cache

    enable_compilation_cache(CACHE_DIR)


def golden_prompts() -> list[dict]:
    return json.loads((GOLDEN_DIR / "prompts.json").read_text())


def golden_arrays(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN_DIR / f"{name}.npz"))


def _hidden_states(runner, ids: list[int], bucket: tuple[int, int]) -> np.ndarray:
    """Runs one sequence through the plan's step in chunks of the bucket's token count (KV in
    blocks 0, 1, ...) and returns every position's final hidden state (before the last norm)."""
    T, S = bucket
    bs, M = runner.block_size, runner.max_blocks_per_seq
    n = len(ids)
    assert -(-n // bs) <= min(M, runner.num_blocks)
    tables = np.zeros((S, M), np.int32)
    tables[0] = np.arange(M)
    rows = []
    for start in range(0, n, T):
        c = min(T, n - start)
        pos = np.arange(start, start + c)
        tokens = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, -1, np.int32)
        tokens[:c], positions[:c], slots[:c] = ids[start:start + c], pos, pos  # blocks 0..k in order
        ctx = np.zeros(S, np.int32)
        ctx[0] = start + c
        cu = np.full(S + 1, c, np.int32)
        cu[0] = 0
        outs = runner.execute(bucket, {"tokens": tokens, "positions": positions, "slot_mapping": slots,
                                       "block_tables": tables, "context_lens": ctx, "cu_q_lens": cu,
                                       "logits_indices": np.zeros(S, np.int32)})
        rows.append(np.asarray(outs["hidden"])[:c])
    return np.concatenate(rows)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def golden_teacher_forced(runner) -> tuple[int, int, dict[str, float]]:
    """Each golden prompt and its fp32 greedy continuation through `runner` in 32-token chunks
    (later chunks read the earlier ones from the KV pools), the plan's own head on the positions
    from the prompt's last on: (positions whose top-1 is the golden next token, positions, and per
    prompt KL(fp32 || ours) of the last prompt position's distribution)."""
    agree, total, kls = 0, 0, {}
    for p in golden_prompts():
        g = golden_arrays(p["name"])
        prompt, gen = g["prompt_ids"].tolist(), g["gen_ids"].tolist()
        logits = runner.lm_head(_hidden_states(runner, prompt + gen[:-1], (32, 4))[len(prompt) - 1:])
        agree += int(np.sum(logits.argmax(-1) == np.asarray(gen)))
        total += len(gen)
        lp_ref, lp = _log_softmax(g["last_logits"]), _log_softmax(logits[0])
        kls[p["name"]] = float(np.sum(np.exp(lp_ref) * (lp_ref - lp)))
    return agree, total, kls


def golden_llm(smollm2, **engine):
    """An LLM on the real SmolLM2 sized for the golden accuracy tests (the longest golden prompt,
    293 tokens, plus 32 generated; 32-token steps), with these EngineConfig fields."""
    from config.engine_config import EngineConfig
    from runtime.entrypoints.llm import LLM
    from runtime.engine.plan import compile_plan

    config, weights, tok = smollm2
    args = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64) | engine
    return LLM.from_plan(compile_plan(None, EngineConfig(**args), weights=weights, config=config, tokenizer=tok))


def golden_free_running(llm, max_tokens: int = 32) -> list[tuple[list[int], list[int]]]:
    """(our greedy tokens, the golden fp32 ones) for each golden prompt, generated through `llm`."""
    from runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    names = [p["name"] for p in golden_prompts()]
    outs = llm.generate([golden_arrays(n)["prompt_ids"].tolist() for n in names], params)
    return [(o.outputs[0].token_ids, golden_arrays(n)["gen_ids"].tolist()[:max_tokens]) for n, o in zip(names, outs)]


def first_divergence(ours: list[int], golden: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, golden)) if a != b), len(golden))


def tiny_llm(seed: int = 2, check_invariants: bool = True, config=None, tokenizer=None, **engine):
    """LLM over `config` (the tiny preset by default) with random weights (`seed`), `tokenizer`
    if given, and these EngineConfig fields: the tests' one way to build a small engine."""
    from models.config import get_preset
    from models.weights import random_weights
    from config.engine_config import EngineConfig
    from runtime.entrypoints.llm import LLM
    from runtime.engine.plan import compile_plan

    cfg = config or get_preset("tiny")
    plan = compile_plan(None, EngineConfig(**engine), weights=random_weights(cfg, seed=seed), config=cfg,
                        tokenizer=tokenizer)
    return LLM.from_plan(plan, check_invariants=check_invariants)


def one_step_logits(graph, weights, seed: int = 0) -> np.ndarray:
    """Logits of one prefill step of `graph` (4 sequences x 4 random tokens, KV pools zeroed), jitted with
    no mesh: a sharded graph computes on one device what its annotations say."""
    import jax

    from runtime.worker.executor import build_step, to_device_params
    from runtime.worker.params import materialize

    T, S, M = 16, 4, 8
    rng = np.random.default_rng(seed)
    inputs = {"tokens": rng.integers(0, 256, T).astype(np.int32),
              "positions": np.tile(np.arange(4), 4).astype(np.int32),
              "slot_mapping": (np.repeat(np.arange(4), 4) * 16 * M + np.tile(np.arange(4), 4)).astype(np.int32),
              "block_tables": (np.arange(S)[:, None] * M + np.arange(M)[None, :]).astype(np.int32),
              "context_lens": np.full(S, 4, np.int32), "cu_q_lens": np.arange(0, T + 1, 4).astype(np.int32),
              "logits_indices": np.arange(3, T, 4).astype(np.int32)}
    state = {x.name: np.zeros((32,) + tuple(x.shape[1:]), np.float32)
             for x in graph.runtime_inputs if "_pool." in x.name}
    outs, _ = jax.jit(build_step(graph))(to_device_params(graph, materialize(graph, weights)), state, inputs)
    return np.asarray(outs["logits"])


def tiny_bpe_tokenizer():
    """A byte-level BPE of 262 tokens (the 256 bytes, 5 merges, <eos> = 261): a real tokenizer for
    fast tests of structured outputs."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    from models.tokenizer import Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("a", "b"), ("1", "2"), ('"', "a"), ("Ġ", "a"), ("{", '"')]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return Tokenizer(backend, eos_token="<eos>")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code():
    """After each test module, drop JAX's trace caches and what they alone hold. A worker of the
    two that scripts/test.sh runs builds hundreds of tiny engines, and XLA:CPU keeps each compiled
    bucket resident (docs/compiler.md): two workers at about 9 GB each got one OOM-killed on a
    24 GB machine. Engines that fixtures keep alive keep their own executables."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def smollm2():
    """(config, weights, tokenizer) of the real SmolLM2-135M-Instruct, loaded once."""
    from models.weights import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smol_llm(smollm2):
    """A warmed-up LLM on the real SmolLM2 (f32), shared by the end-to-end tests."""
    from runtime.engine.plan import compile_plan
    from config.engine_config import EngineConfig
    from runtime.entrypoints.llm import LLM

    config, weights, tok = smollm2
    plan = compile_plan(None, EngineConfig(**SMOL_ARGS), weights=weights, config=config, tokenizer=tok)
    return LLM.from_plan(plan, check_invariants=True)


# Tests that touch the real SmolLM2 (its GGUF weights or tokenizer) are `slow`: the fast loop is
# `bash scripts/test.sh -m "not slow"` (two processes). Anything using the shared fixtures is marked here, in
# one place; tests that load the model another way carry the mark themselves.
REAL_MODEL_FIXTURES = {"smollm2", "smol_llm", "smol_plan", "gguf_fields", "gguf_reader", "tok"}


# Besides the real models, `slow` marks the tests that take more than about 7 s warm on 2 cores
# (engines compiled for one check, several engines compared, process pairs): the fast loop keeps the
# cheap ones. Parametrized grids of a kernel against its reference keep a cross-section there: every
# k-th case (in collection order, which spreads it over the grid's axes) stays fast, the rest are slow.
THINNED_GRIDS = {
    "test_xla_attention.py::test_xla_lowering_matches_the_reference": 7,
    "test_xla_attention.py::test_sliding_window_matches_the_reference": 4,
    "test_cli.py::test_readme_command": 4,
    "test_paged_attention.py::test_heads_and_dtypes": 5,
    "test_paged_attention.py::test_ragged_contexts": 4,
    "test_paged_attention.py::test_sliding_window_skips_pages_behind_it": 3,
    "test_flash_attention.py::test_heads_and_dtypes": 4,
    "test_gguf_tiles.py::test_kernel_matches_rounded_product": 5,
    "test_memory_fit.py::test_gpu_plans_from_the_allocators_numbers": 4,
    "test_cpp_kernels.py::test_decode_rows_match_the_reference": 3,
}


def _thin_grids(items) -> None:
    seen: dict[str, int] = {}
    for item in items:
        key = f"{item.path.name}::{item.originalname}"
        if key in THINNED_GRIDS:
            i = seen[key] = seen.get(key, -1) + 1
            if i % THINNED_GRIDS[key]:
                item.add_marker(pytest.mark.slow)


# The smoke loop (`bash scripts/test.sh -m smoke`): modules that compile no model (the command
# line, the IR and passes, the host-only engine core, grammars, docs), less their tests that plan
# big presets or start subprocesses. What it costs is in the README.
SMOKE_MODULES = {"test_layering", "test_docs", "test_block_manager", "test_scheduler", "test_engine_config",
                 "test_detokenizer", "test_spec_decode", "test_structured_output", "test_ir", "test_passes",
                 "test_build", "test_bench_soak", "test_tokenizer", "test_cli", "test_tool_parsers", "test_host_memory"}
NOT_SMOKE = {"test_dry_run_that_does_not_fit_exits_2_with_advice_that_fits", "test_dry_run_that_fits_exits_0",
             "test_python_m_forms_give_the_same_one_line_errors", "test_engine_args_that_cannot_work",
             "test_readme_command", "test_the_suite_without_golden_data_says_where_it_lives",
             "test_text_prompts_get_the_tokenizers_bos"}


def pytest_collection_modifyitems(config, items):
    _thin_grids(items)
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if (item.module.__name__.rpartition(".")[2] in SMOKE_MODULES and item.originalname not in NOT_SMOKE
                and not item.get_closest_marker("slow")):
            item.add_marker(pytest.mark.smoke)


# ------------------------------------------------------------------ the C++ kernels' CPU targets

# The x86 builds the kernel and engine-numerics tests also run against, beside the default one
# (JAXSERVE_CPU_TARGET as the environment has it): AVX2 and AVX-512 without VNNI or AMX. Each test
# takes a few representative cases for them (cpu_target_cases), not its whole matrix.
EXTRA_CPU_TARGETS = ("x86-64-v3", "x86-64-v4")


def cpu_target_cases(cases, extra=None) -> list:
    """pytest params: every case of `cases` (tuples, or single values) under the default build, then
    those of `extra` (default: all of `cases`) under each of EXTRA_CPU_TARGETS; the last argument is
    the `cpu_target` fixture's (indirect), None for the default."""
    def as_tuple(c):
        return c if isinstance(c, tuple) else (c,)
    out = [pytest.param(*as_tuple(c), None, id="-".join(map(str, as_tuple(c))) + "-default") for c in cases]
    for target in EXTRA_CPU_TARGETS:
        out += [pytest.param(*as_tuple(c), target, id="-".join(map(str, as_tuple(c))) + f"-{target}")
                for c in (cases if extra is None else extra)]
    return out


@pytest.fixture
def cpu_target(request, monkeypatch):
    """Runs the test with the C++ kernels built for `request.param` (JAXSERVE_CPU_TARGET; None: as
    the environment has it), skipped where this CPU cannot run that target's code (a build that
fails is a failure). JAX's
    trace caches are cleared on the way in and out: a function traced under one target calls that
    build's kernels."""
    import jax

    from runtime.worker import cpp_kernels

    target = getattr(request, "param", None)
    if target is None:
        yield cpp_kernels.cpu_target()
        return
    try:
        cpp_kernels._target_flags(target)
    except cpp_kernels.KernelUnavailable as e:  # this CPU cannot run the target's code
        pytest.skip(str(e))
    monkeypatch.setenv("JAXSERVE_CPU_TARGET", target)
    assert cpp_kernels.available(), f"the {target} build of the C++ kernels failed: {cpp_kernels._load()}"
    jax.clear_caches()
    yield target
    jax.clear_caches()


@contextlib.contextmanager
def front_over(urls: list[str], names: list[str], api_key: str | None = None, policy: str = "cache_aware"):
    """What `serve --data-parallel-size N` puts on the user's port (runtime.distributed.front), over
    servers already running at `urls` (replica i is urls[i]). Yields the front's URL."""
    from runtime.entrypoints.openai.serving import ServerConfig
    from runtime.distributed.front import Upstream
    from runtime.distributed.replicas import start_front

    ups = [Upstream(i, u) for i, u in enumerate(urls)]
    front, thread = start_front(ServerConfig(list(names), api_key), lambda: ups, lambda: ups, "127.0.0.1", 0,
                                urls[0], policy)
    try:
        yield thread.url
    finally:
        thread.stop()
