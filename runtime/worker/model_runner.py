"""Runs a plan on the device: params and KV pools in memory, one AOT-compiled executable per bucket."""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ir import bind_shape
from ir.head import HEAD_INPUT, head_graph
from ir.kv_groups import (BLOCK_TABLES, BLOCKS_DIM, SLOT_MAPPING, WINDOW_BLOCK_TABLES, WINDOW_BLOCKS_DIM,
                          WINDOW_SLOT_MAPPING, is_window_pool, kv_window)
from config.flags import DoesNotFit
from passes.plan_memory import MemoryPlan
from runtime.worker.executables import ExecutableStore, num_backend_compiles  # noqa: F401  (re-exported)
from runtime.worker.executor import JNP_DTYPES, build_step, resolve_backend, scans_layers, state_names, step_layout
from runtime.worker import kernels, sampler

log = logging.getLogger("runtime.worker.model_runner")

# What the step returns beyond the graph's outputs: the sampler's results, one row per sequence.
SAMPLED_OUTPUTS = ("tokens", "chosen_logprobs", "top_ids", "top_logprobs")
# ...and the sampled tokens again, padded to a fixed width, for the next step to take its decode
# tokens from without a host round trip (async scheduling; ModelRunner.execute's `feed`).
FEED_OUTPUT = "feed"

def enable_compilation_cache(cache_dir: str | Path) -> None:
    """JAX's persistent compilation cache: a second start loads executables instead of compiling."""
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# ---------------------------------------------------------------- prompt logprobs

PROMPT_LOGPROB_CHUNK = 64


def _log_probs(logits, targets):
    """logits [C, V] -> (target logprob [C], top-20 ids, top-20 logprobs), in f32."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, 20)
    return jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0], top_ids, top_lp


def _copy_blocks(pools, src, dst, window_src, window_dst, *, num_layers: int, window_keys=frozenset()):
    """Copy-on-write of KV blocks: dst[i] <- src[i] in every pool of the full group, window_dst[i] <-
    window_src[i] in every pool of the window group (`window_keys`; ir.kv_groups), every layer of a
    flat multi-layer pool, whose layer l owns blocks [l*B, (l+1)*B); dst -1 pairs are padding."""

    def copy(pool, src, dst):
        total = pool.shape[0]
        offsets = (jnp.arange(num_layers, dtype=jnp.int32) * (total // num_layers))[:, None]
        src = (offsets + src[None, :]).reshape(-1)
        dst = jnp.where(dst[None, :] < 0, total, offsets + dst[None, :]).reshape(-1)
        return pool.at[dst].set(jnp.take(pool, src, axis=0, mode="clip"), mode="drop")

    return {k: copy(v, *((window_src, window_dst) if k in window_keys else (src, dst))) for k, v in pools.items()}


def _advance_decode(inputs: dict, tokens, block_size: int) -> dict:
    """The next decode step's inputs on the device: token i (of sequence i) is the one just
    sampled for row i, one position further, its KV slot looked up in its block table (in each
    KV cache group's table: ir.kv_groups)."""
    real = inputs[SLOT_MAPPING] >= 0
    n = inputs["tokens"].shape[0]
    positions = jnp.where(real, inputs["positions"] + 1, inputs["positions"])
    new_tokens = jnp.where(real, tokens[jnp.minimum(jnp.arange(n), tokens.shape[0] - 1)], inputs["tokens"])
    context_lens = jnp.where(inputs["context_lens"] > 0, inputs["context_lens"] + 1, 0)
    out = dict(inputs, tokens=new_tokens.astype(jnp.int32), positions=positions, context_lens=context_lens)
    for slots_name, tables_name in ((SLOT_MAPPING, BLOCK_TABLES), (WINDOW_SLOT_MAPPING, WINDOW_BLOCK_TABLES)):
        if slots_name in inputs:
            tables = inputs[tables_name]
            seq = jnp.minimum(jnp.arange(n), tables.shape[0] - 1)
            block = tables[seq, jnp.minimum(positions // block_size, tables.shape[1] - 1)]
            out[slots_name] = jnp.where(real, block * block_size + positions % block_size, -1)
    return out


def on_every_rank(method):
    """A call that runs a computation on the mesh: under multi-process tensor parallelism every
    process must run it, in the same order on the same arrays. Rank 0's runner sends it to the
    other ranks (`mirror`, runtime.distributed.multiprocess.Leader) before running it."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.mirror is not None:
            self.mirror.call(method.__name__, args, kwargs)
        return method(self, *args, **kwargs)

    return run


# A KV pool sized from the prediction is kept when XLA's measured peak leaves it at least this
# many blocks and at most this fraction more: growing it means compiling every executable again
# for the new pool shape, which a few percent of the pool is not worth.
KV_REGROW_FRACTION = 0.05


def _mib(b: int) -> str:
    return f"{b / 2**20:.1f} MiB"


def _budget_text(memory: MemoryPlan) -> str:
    return (f"the budget is {_mib(memory.budget_bytes)} (memory_utilization {memory.memory_utilization} x "
            f"device {_mib(memory.device_memory_bytes)}"
            + (f", allocator limit {_mib(memory.memory_limit_bytes)}" if memory.memory_limit_bytes is not None else "")
            + (f", per device at tensor_parallel_size {memory.tensor_parallel_size}"
               if memory.tensor_parallel_size > 1 else "") + ")")


def bar_label(desc: str, loaded: int, total: int) -> str:
    """The start-up bar's label: "load buckets" when the executable store held every bucket (a
    warm start compiles nothing), else `desc` with how many of them it held."""
    if total and loaded == total:
        return desc.replace("compile buckets", "load buckets", 1)
    return f"{desc} ({loaded} of {total} loaded)" if loaded else desc


def check_fit(memory: MemoryPlan, measured_peak: int | None = None) -> None:
    """Raises DoesNotFit (a MemoryError), with the numbers, when weights + KV pools + the activation
    peak exceed what the device (and its allocator) can give: better to stop at start than to sit
    in allocator retries or fail in the middle of serving. Only a block count the user fixed can
    fail here (`num_kv_blocks`, or the KV bytes: `kv_cache_memory_bytes`, VLLM_CPU_KVCACHE_SPACE):
    the engine sizes its own pool to fit (ModelRunner.fit_kv_pool)."""
    peak = memory.peak_activation_bytes if measured_peak is None else measured_peak
    need = memory.weight_bytes + memory.kv_cache_bytes + peak
    if need <= memory.budget_bytes:
        return
    which = "planned" if measured_peak is None else "measured"
    room = memory.budget_bytes - memory.weight_bytes - peak - memory.reserve_bytes
    fits = (f"--kv-cache-memory {max(room, 0) // 2**20}MiB or less fits" if memory.kv_cache_memory_bytes is not None
            and memory.num_kv_blocks == memory.kv_blocks_in(memory.kv_cache_memory_bytes)[0]
            else f"--num-kv-blocks {memory.blocks_that_fit(peak)} or fewer fits")
    raise DoesNotFit(
        f"the plan does not fit: weights {_mib(memory.weight_bytes)} + KV cache "
        f"{_mib(memory.kv_cache_bytes)} ({memory.num_kv_blocks} blocks) + {which} activation peak "
        f"{_mib(peak)} = {_mib(need)}, but {_budget_text(memory)}; {fits} "
        f"(or leave it to the memory plan), or raise memory_utilization")


class ModelRunner:
    """Owns the device state of a plan and executes one bucketed step at a time."""

    def __init__(self, plan, backend: str | None = None, mesh=None, executables: str | Path | None = None,
                 release_host_weights: bool = False, shared_executables: str | Path | None = None):
        """The persistent compilation cache is set by runtime.engine.build.build_runner, not here; so is
        `executables`, the directory of an ExecutableStore (runtime.worker.executables), which
        saves this runner's compiled executables whole (not under tensor parallelism: a sharded
        executable's devices are not part of the store's key). `shared_executables`: another
        store that backs it (ExecutableStore's `shared`).

        `release_host_weights`: once the weights are on the device, drop the plan's host copy
        (`plan.weights = None`), for an owner that will neither save the plan nor build another
        runner from it (the server). On CPU the device arrays are host memory too, so the copy
        would stay resident beside them (SmolLM2's f32 server: RSS 5,103 -> 4,712 MiB at /health)."""
        self.plan = plan
        self.graph = plan.graph
        self.mirror = None  # rank 0 of a multi-process engine: sends each device call to the others
        engine = plan.engine
        self.backend = backend or engine.kernel_backend
        self.block_size = engine.block_size
        self.max_blocks_per_seq = math.ceil(engine.max_model_len / engine.block_size)
        self.num_blocks = plan.num_kv_blocks
        # The window group's pools (ir.kv_groups): their window and block count (0: no such group).
        self.kv_window = kv_window(self.graph)
        self.num_window_blocks = plan.memory.num_window_kv_blocks if self.kv_window is not None else 0
        self.max_model_len = engine.max_model_len
        self.vocab_size = plan.config.vocab_size
        if mesh is None and engine.tensor_parallel_size > 1:
            from runtime.worker.sharding import TensorParallelMesh

            mesh = TensorParallelMesh.for_graph(self.graph, engine.tensor_parallel_size)
        self.mesh = mesh
        self.backend = resolve_backend(self.backend, sharded=mesh is not None)
        self.state_names = state_names(self.graph)
        scan = scans_layers(engine, sharded=mesh is not None, graph=self.graph)
        self.layout = step_layout(self.graph, scan_layers=scan)
        check_fit(plan.memory)  # before any weight or pool reaches the device
        self.params = self._put_params(plan.weights)
        if release_host_weights:
            plan.weights = None
        self.state = self._alloc_state()
        self.executables = None
        if executables is not None and mesh is None:
            (device,) = next(iter(self.params.values())).devices()
            self.executables = ExecutableStore(executables, device, plan.program_hash(), self.backend,
                                               shared=shared_executables)
        self.compiled: dict[tuple[int, int], object] = {}
        # XLA's memory analysis of each compiled executable, per device: (temporaries, the
        # executable's own argument and result buffers less weights and KV pools). Steps by bucket;
        # the others (multi-step decode, copy_blocks, prompt logprobs) by name.
        self.xla_memory: dict[tuple[int, int], tuple[int, int]] = {}
        self.xla_memory_other: dict[str, tuple[int, int]] = {}
        model_step = build_step(self.graph, self.backend, mesh_constraints=getattr(mesh, "constrain", None),
                                per_device=getattr(mesh, "per_device", None),
                                layout=self.layout)

        def step(params, state, inputs, sampling):
            # The model and the sampler in one executable: one dispatch per step, and the logits
            # never leave the device.
            outs, new_state = model_step(params, state, inputs)
            sampled = sampler.sample_rows(outs["logits"], sampling)
            return dict(outs, **dict(zip(SAMPLED_OUTPUTS, sampled))), new_state

        # Async scheduling: a step may take some input tokens from the previous step's sampled
        # rows, still on the device. `feed` is that step's FEED_OUTPUT (its tokens padded to the
        # table's widest bucket, so every pair of buckets fits) and, per input token, the row to
        # take (-1: the host's token).
        self.feed_rows = plan.buckets.max_seqs

        def fed_step(params, state, inputs, sampling, feed, feed_index):
            take = feed[jnp.clip(feed_index, 0, feed.shape[0] - 1)]
            inputs = dict(inputs, tokens=jnp.where(feed_index >= 0, take, inputs["tokens"]))
            outs, new_state = step(params, state, inputs, sampling)
            tokens = outs["tokens"]
            outs[FEED_OUTPUT] = jnp.zeros(self.feed_rows, jnp.int32).at[:tokens.shape[0]].set(tokens)
            return outs, new_state

        self._step = jax.jit(fed_step, donate_argnums=(1,))
        self._no_feed = None  # the all-padding feed, put on the device once
        self._feed_off: dict[int, np.ndarray] = {}
        self._idle_sampling: dict[int, dict] = {}
        # Multi-step decode (vLLM's num_scheduler_steps): K decode steps in one executable, each
        # feeding its sampled tokens to the next on the device; compiled for the buckets an
        # all-decode step lands in.
        self.num_scheduler_steps = engine.num_scheduler_steps
        self.multi_step_buckets = set()
        if self.num_scheduler_steps > 1:
            self.multi_step_buckets = {plan.buckets.pick(n, n) for n in range(1, engine.max_num_seqs + 1)}
        block_size = self.block_size

        def multi_step(params, state, inputs, sampling):
            def body(k, carry):
                state, inputs, sampling, acc = carry
                outs, state = step(params, state, inputs, sampling)
                acc = tuple(a.at[k].set(outs[name]) for a, name in zip(acc, SAMPLED_OUTPUTS))
                inputs = _advance_decode(inputs, outs["tokens"], block_size)
                sampling = dict(sampling, counters=sampling["counters"] + 1)
                return state, inputs, sampling, acc

            s = sampling["temperature"].shape[0]
            k = self.num_scheduler_steps
            acc = (jnp.zeros((k, s), jnp.int32), jnp.zeros((k, s), jnp.float32),
                   jnp.zeros((k, s, sampler.NUM_TOP_LOGPROBS), jnp.int32),
                   jnp.zeros((k, s, sampler.NUM_TOP_LOGPROBS), jnp.float32))
            state, _, _, acc = jax.lax.fori_loop(0, k, body, (state, inputs, sampling, acc))
            return dict(zip(SAMPLED_OUTPUTS, acc)), state

        self._multi_step = jax.jit(multi_step, donate_argnums=(1,))
        self.compiled_multi: dict[tuple[int, int], object] = {}
        by_name = {leaf.name: leaf for leaf in self.graph.runtime_inputs}
        window_keys = frozenset(k for k, names in self.layout.state_groups.items() if is_window_pool(by_name[names[0]]))
        self._copy = jax.jit(partial(_copy_blocks, num_layers=self.layout.num_layers, window_keys=window_keys),
                             donate_argnums=(0,))
        self._copy_compiled = None
        # Prompt logprobs run the step graph's own LM head (ir.head: final norm + LM head as the
        # passes left them: int8, sharded), cut out as a graph over rows of hidden states.
        self.head = head_graph(self.graph)
        head_step = build_step(self.head, self.backend, mesh_constraints=getattr(mesh, "constrain", None))
        self._head_dtype = JNP_DTYPES[self.head.inputs[0].dtype]

        def head_logprobs(params, rows, targets):
            outs, _ = head_step(params, {}, {HEAD_INPUT: rows})
            return _log_probs(outs["logits"], targets)

        self._head_logprobs = jax.jit(head_logprobs)
        self._head_logits = jax.jit(lambda params, rows: head_step(params, {}, {HEAD_INPUT: rows})[0]["logits"])
        self._head_params = {p.name: self.params[p.name] for p in self.head.params}

    # ------------------------------------------------------------ device state

    def _put_params(self, weights):
        """Weights on the device by layout key: one array per param, or a layer stack [L, ...]."""
        if weights is None:
            raise ValueError("the plan has no weights loaded")
        by_name = {p.name: p for p in self.graph.params}
        out = {}
        for key, names in self.layout.param_groups.items():
            p = by_name[names[0]]
            host = np.dtype(weights[names[0]].dtype) if p.dtype in ("i8", "u8") else np.float32
            parts = [np.asarray(weights[n], dtype=host) for n in names]
            arr = parts[0] if len(names) == 1 and key == names[0] else np.stack(parts)
            if self.mesh is not None:
                # Straight from host to each device's shard: no device ever holds a whole weight.
                out[key] = self.mesh.put_param(p, arr, JNP_DTYPES[p.dtype], stacked=arr.ndim > len(p.shape))
            else:
                out[key] = jnp.asarray(arr, dtype=JNP_DTYPES[p.dtype])
        return out

    def _alloc_state(self):
        """KV pools by layout key; a scanned layout keeps one flat [L * B, ...] pool per role."""
        by_name = {leaf.name: leaf for leaf in self.graph.runtime_inputs}

        def zeros(item):
            key, names = item
            leaf = by_name[names[0]]
            shape = bind_shape(leaf.shape, {BLOCKS_DIM: self.num_blocks * len(names),
                                            WINDOW_BLOCKS_DIM: self.num_window_blocks * len(names)})
            device = self.mesh.node_sharding(leaf) if self.mesh is not None else None
            dtype = kernels.pool_storage_dtype(JNP_DTYPES[leaf.dtype], resolve_backend(self.backend))
            return key, jax.block_until_ready(jnp.zeros(shape, dtype, device=device))

        # Zeroing a pool is one thread's page faults, gigabytes of them: the pools side by side
        # (1.4 against 2.2 s for SmolLM2's two 1.5 GB pools on 2 cores).
        groups = self.layout.state_groups.items()
        with ThreadPoolExecutor(max_workers=max(1, min(len(groups), os.cpu_count() or 1))) as pool:
            return dict(pool.map(zeros, groups))

    def kv_cache_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in self.state.values())

    # ------------------------------------------------------------ shapes

    def input_specs(self, num_tokens: int, num_seqs: int) -> dict[str, jax.ShapeDtypeStruct]:
        env = {"T": num_tokens, "S": num_seqs, "R": num_seqs, "M": self.max_blocks_per_seq,
               BLOCKS_DIM: self.num_blocks, WINDOW_BLOCKS_DIM: self.num_window_blocks}
        return {leaf.name: jax.ShapeDtypeStruct(bind_shape(leaf.shape, env), JNP_DTYPES[leaf.dtype])
                for leaf in self.graph.runtime_inputs if leaf.name not in self.state_names}

    def _abstract(self, tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)

    def _compile(self, what: str, jitted, *args):
        """`jitted` AOT-compiled for abstract `args`: from the executable store when there is one
        (no tracing at all on a hit), else lowered and compiled (XLA's persistent cache may still
        skip the compile)."""
        if self.executables is not None:
            return self.executables.compile(what, jitted, *args)
        return jitted.lower(*args).compile()

    def _step_args(self, bucket: tuple[int, int]) -> tuple:
        return (self._abstract(self.params), self._abstract(self.state), self.input_specs(*bucket),
                sampler.input_specs(bucket[1], self.max_model_len, self.vocab_size),
                jax.ShapeDtypeStruct((self.feed_rows,), jnp.int32), jax.ShapeDtypeStruct((bucket[0],), jnp.int32))

    def compile_bucket(self, bucket: tuple[int, int]):
        if bucket not in self.compiled:
            self.compiled[bucket] = self._compile("step", self._step, *self._step_args(bucket))
        return self.compiled[bucket]

    def _load_stored_buckets(self, buckets) -> int:
        """The buckets' steps that the executable store holds, loaded on all cores at once (1.85x
        faster than one at a time on 2 cores); the rest are left to compile_bucket. Returns how
        many it loaded."""
        if self.executables is None:
            return 0
        todo = [b for b in buckets if b not in self.compiled]
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            found = list(pool.map(lambda b: self.executables.load("step", *self._step_args(b)), todo))
        self.compiled.update((b, c) for b, c in zip(todo, found) if c is not None)
        return sum(c is not None for c in found)

    def compile_multi_step(self, bucket: tuple[int, int]):
        if bucket not in self.compiled_multi:
            self.compiled_multi[bucket] = self._compile(
                "multi_step", self._multi_step, self._abstract(self.params), self._abstract(self.state),
                self.input_specs(*bucket), sampler.input_specs(bucket[1], self.max_model_len, self.vocab_size))
        return self.compiled_multi[bucket]

    @on_every_rank
    def execute_multi_step(self, bucket: tuple[int, int], inputs: dict[str, np.ndarray], sampling: dict):
        """num_scheduler_steps decode steps of an all-decode batch (one new token per sequence,
        token i of sequence i, blocks allocated for every step): the sampled rows, each [K, S, ...],
        as device arrays. Tokens past a stop are the host's to drop."""
        outs, self.state = self.compiled_multi[bucket](self.params, self.state, inputs, sampling)
        if self.mesh is not None:
            outs = {k: self.mesh.local_copy(v) for k, v in outs.items()}
        return outs

    @property
    def first_runs_are_slow(self) -> bool:
        """Whether a step executable's first run costs much more than its later ones. On CPU, an
        unrolled step's first run is 2-3x slower (XLA builds each of its per-layer YNNPACK fusions
        on first use); a scanned step has one layer's fusions, and its first runs took 1.09x the
        second ones, summed over SmolLM2's 20 buckets (4.5 against 4.1 s, the rest all compute).
        Off CPU it has not been measured, so it counts as slow (docs/benchmarks/, "Start-up")."""
        return self.layout.layers is None or jax.default_backend() != "cpu"

    def warmup(self, progress: bool = False, execute: bool | str = False) -> float:
        """AOT-compiles every executable (the buckets' steps, model + sampler; multi-step decode;
        block copies; prompt logprobs), from the persistent cache when warm, then sizes the KV
        pool from XLA's measured peak (fit_kv_pool): when that changes the pool's block count, the
        pools are allocated again and everything compiles again for their new shape.

        With `execute`, also runs each bucket once on all-padding inputs (nothing is written to
        the KV pools), so that a timed run or a first request does not pay an executable's first
        run. One run is enough: the second already runs at the third's speed (docs/benchmarks/,
        "Start-up"). `execute="auto"` (the server's) runs them only where `first_runs_are_slow`:
        elsewhere they would add the buckets' compute to the start (4.5 s for SmolLM2 on 2 cores)
        to save 0.4 s spread over the first requests.
        """
        if execute == "auto":
            execute = self.first_runs_are_slow
        t0 = time.perf_counter()
        num_backend_compiles()
        self._compile_all(progress)
        if self.fit_kv_pool():
            self._compile_all(progress, desc="compile buckets for the resized KV pool")
            self.fit_kv_pool(resize=False)
        if execute:
            self.run_each_bucket()
        return time.perf_counter() - t0

    def run_each_bucket(self) -> None:
        """Runs each bucket's step once on all-padding inputs (nothing is written to the KV pools)."""
        for b in self.plan.buckets.pairs():
            args = {k: np.zeros(v.shape, v.dtype) for k, v in self.input_specs(*b).items()}
            for name in (SLOT_MAPPING, WINDOW_SLOT_MAPPING):
                if name in args:
                    args[name][:] = -1  # padding tokens write nothing
            jax.block_until_ready(self.execute(b, args))

    def _measure(self, compiled) -> tuple[int, int]:
        """(temporaries, own buffers) of a compiled executable on one device, from XLA's analysis:
        its arguments and results less the weights and the KV pools (donated: a result aliases them)."""
        m = compiled.memory_analysis()
        resident = self._device_bytes(self.params) + self._device_bytes(self.state)
        own = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes - resident
        return int(m.temp_size_in_bytes), max(int(own), 0)

    @staticmethod
    def _device_bytes(tree) -> int:
        """Bytes of `tree`'s arrays on one device (a shard of a split array, all of a replicated one)."""
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    def _compile_all(self, progress: bool = False, desc: str = "compile buckets") -> None:
        buckets = self.plan.buckets.pairs()
        loaded = self._load_stored_buckets(buckets)
        it = buckets
        if progress:
            from tqdm import tqdm

            it = tqdm(buckets, desc=bar_label(desc, loaded, len(buckets)), unit="bucket", file=sys.stderr)
        for b in it:
            self.xla_memory[b] = self._measure(self.compile_bucket(b))
        for b in sorted(self.multi_step_buckets):
            self.xla_memory_other[f"multi-step {b[0]}x{b[1]}"] = self._measure(self.compile_multi_step(b))
        n = self.max_num_copy_pairs
        pair = jax.ShapeDtypeStruct((n,), jnp.int32)
        self._copy_compiled = self._compile("copy_blocks", self._copy, self._abstract(self.state), pair, pair, pair, pair)
        self.xla_memory_other["copy_blocks"] = self._measure(self._copy_compiled)
        self._plp_compiled = self._compile(
            "prompt_logprobs", self._head_logprobs, self._abstract(self._head_params),
            jax.ShapeDtypeStruct((PROMPT_LOGPROB_CHUNK, self.plan.config.hidden_size), self._head_dtype),
            jax.ShapeDtypeStruct((PROMPT_LOGPROB_CHUNK,), jnp.int32))
        self.xla_memory_other["prompt_logprobs"] = self._measure(self._plp_compiled)

    def fit_kv_pool(self, resize: bool = True) -> bool:
        """Sizes the KV pool from XLA's measured peak over every compiled executable, as vLLM sizes
        its KV cache after a profiling run: the pool gets what the budget leaves after the weights,
        that peak and the reserve. Returns True when it resized the pool (every executable must
        then compile again, for the new pool shape).

        The pool the prediction sized is kept when it fits the budget beside the measured peak (a
        measurement a little above the prediction eats into the reserve, not into a second compile)
        and the measurement would grow it by less than KV_REGROW_FRACTION. A block count the user fixed (`num_kv_blocks`) is kept, or
        refused with the numbers; so is a max_model_len whose one sequence no longer fits. The
        plan's memory is updated with the measurement and the final count (`plan.memory`). The pool
        never grows past what the configuration can use (MemoryPlan.max_kv_blocks), and KV bytes
        the user fixed are kept, or refused, like a block count."""
        memory = self.memory_with_xla(self.plan.memory)
        measured = memory.measured_peak_bytes
        planned = memory.planned_kv_blocks if memory.planned_kv_blocks is not None else memory.num_kv_blocks
        log.info("activation peak: predicted %.1f MiB, measured (XLA) %.1f MiB over %d executables",
                 memory.peak_activation_bytes / 2**20, measured / 2**20,
                 len(self.xla_memory) + len(self.xla_memory_other))
        engine = self.plan.engine
        blocks, window_blocks = self.num_blocks, self.num_window_blocks
        fits = memory.blocks_that_fit(measured)
        within = memory.weight_bytes + memory.kv_cache_bytes + measured <= memory.budget_bytes
        if engine.num_kv_blocks is not None or memory.kv_cache_memory_bytes is not None or not resize:
            check_fit(memory, measured)
        elif not (within and fits <= self.num_blocks * (1 + KV_REGROW_FRACTION)):
            need = -(-engine.max_model_len // engine.block_size)
            if fits < need:
                raise DoesNotFit(
                    f"the plan does not fit: weights {_mib(memory.weight_bytes)} + measured activation "
                    f"peak {_mib(measured)} (predicted {_mib(memory.peak_activation_bytes)}) + reserve "
                    f"{_mib(memory.reserve_bytes)} leave room for {fits} KV blocks ({fits * engine.block_size} "
                    f"tokens), fewer than one max_model_len={engine.max_model_len} sequence needs, and "
                    f"{_budget_text(memory)}; lower --max-model-len to {fits * engine.block_size} or less, "
                    "lower --max-num-batched-tokens or --max-num-seqs (the peak grows with the largest "
                    "bucket), or raise --memory-utilization")
            log.info("KV pool sized from the measured peak: %d blocks (the prediction gave %d)", fits, blocks)
            blocks, window_blocks = memory.kv_blocks_that_fit(measured)
        self.plan.memory = memory.with_blocks(blocks, window_blocks, planned_kv_blocks=planned)
        if blocks == self.num_blocks and window_blocks == self.num_window_blocks:
            return False
        self.state = None  # the old pools go before the new ones arrive
        self.compiled.clear()
        self.compiled_multi.clear()
        self._copy_compiled = self._plp_compiled = None
        self.xla_memory.clear()
        self.xla_memory_other.clear()
        self.num_blocks, self.num_window_blocks = blocks, window_blocks
        self.state = self._alloc_state()
        return True

    @property
    def max_num_copy_pairs(self) -> int:
        return self.plan.engine.max_num_seqs

    def memory_with_xla(self, memory: MemoryPlan) -> MemoryPlan:
        """`memory` with XLA's numbers for the executables compiled so far: each bucket's
        temporaries and own buffers, and the peak over every executable (None if none compiled)."""
        buckets = []
        for b in memory.buckets:
            temp, io = self.xla_memory.get((b.num_tokens, b.num_seqs), (None, None))
            buckets.append(replace(b, xla_temp_bytes=temp, xla_io_bytes=io))
        peaks = [t + io for t, io in list(self.xla_memory.values()) + list(self.xla_memory_other.values())]
        return replace(memory, buckets=tuple(buckets), measured_peak_bytes=max(peaks) if peaks else None)

    # ------------------------------------------------------------ execution

    @on_every_rank
    def copy_blocks(self, copies: list[tuple[int, int]], window_copies: list[tuple[int, int]] = ()) -> None:
        """Copy-on-write pairs (src, dst) of the full group's blocks and of the window group's."""
        n = self.max_num_copy_pairs

        def pairs(part):
            src = np.zeros(n, np.int32)
            dst = np.full(n, -1, np.int32)
            src[:len(part)] = [a for a, _ in part]
            dst[:len(part)] = [b for _, b in part]
            return src, dst

        for i in range(0, max(len(copies), len(window_copies)), n):
            fn = self._copy_compiled or self._copy
            self.state = fn(self.state, *pairs(copies[i:i + n]), *pairs(window_copies[i:i + n]))

    @on_every_rank
    def execute(self, bucket: tuple[int, int], inputs: dict[str, np.ndarray], sampling: dict | None = None,
                feed=None, feed_index: np.ndarray | None = None):
        """Runs one step; returns the graph's outputs, the sampled rows (SAMPLED_OUTPUTS) and
        FEED_OUTPUT, as device arrays, without waiting for them. KV pools update in place.
        `sampling`: SamplerInputs.arrays() for the bucket's rows (None: greedy rows). `feed`: an
        earlier step's FEED_OUTPUT, and `feed_index` [T] the row of it each input token takes
        (-1: keep `inputs["tokens"]`); None: all tokens from the host."""
        fn = self.compiled.get(bucket)
        if fn is None:
            raise KeyError(f"bucket {bucket} is not in the plan's bucket table "
                           f"{self.plan.buckets.pairs()}")
        if sampling is None:
            if bucket[1] not in self._idle_sampling:
                self._idle_sampling[bucket[1]] = sampler.build_inputs(
                    [], bucket[1], self.max_model_len, lambda p: [], vocab_size=self.vocab_size).arrays()
            sampling = self._idle_sampling[bucket[1]]
        if feed is None:
            if self._no_feed is None:
                self._no_feed = jax.device_put(np.zeros(self.feed_rows, np.int32))  # uncommitted
            feed = self._no_feed
        if feed_index is None:
            feed_index = self._feed_off.get(bucket[0])
            if feed_index is None:
                feed_index = self._feed_off[bucket[0]] = np.full(bucket[0], -1, np.int32)
                feed_index.flags.writeable = False
        outs, self.state = fn(self.params, self.state, inputs, sampling, feed, feed_index)
        if self.mesh is not None:
            outs = {k: self.mesh.local_copy(v) for k, v in outs.items()}
        return outs

    @on_every_rank
    def lm_head(self, hidden_rows: np.ndarray) -> np.ndarray:
        """f32 logits [R, vocab] of final hidden states (the step's `hidden` output), through the
        graph's own head: what the step computes at `logits_indices`, for any rows."""
        return np.asarray(jax.device_get(self._head_logits(self._head_params,
                                                           np.asarray(hidden_rows).astype(self._head_dtype))))

    @on_every_rank
    def prompt_logprobs(self, hidden_rows: np.ndarray, targets: np.ndarray):
        """Logprobs of `targets` given each row's hidden state, in fixed-size chunks, through the
        graph's own LM head."""
        out_lp, out_ids, out_top = [], [], []
        c = PROMPT_LOGPROB_CHUNK
        for i in range(0, len(targets), c):
            h = np.zeros((c, hidden_rows.shape[1]), np.float32)
            t = np.zeros(c, np.int32)
            n = min(c, len(targets) - i)
            h[:n], t[:n] = hidden_rows[i:i + n], targets[i:i + n]
            lp, ids, top = jax.device_get(self._plp_compiled(self._head_params, h.astype(self._head_dtype), t))
            out_lp.append(lp[:n]); out_ids.append(ids[:n]); out_top.append(top[:n])
        return np.concatenate(out_lp), np.concatenate(out_ids), np.concatenate(out_top)
