"""Our C++ kernels for XLA:CPU. Decode attention (runtime/worker/cpp/paged_decode.cc) against the
jnp reference: decode rows over poisoned paged pools (a read past a row's context gives NaN), at
several head shapes, block sizes and ragged contexts, from f32 pools and from bf16 bits; that it
reads the pool in place (no gather, no copy in the compiled step); and what `auto` does without a
compiler. The products of few rows (cpp/matmul.cc): W8A8 against XLA's dot, bit for bit;
weight-only int8 and f32 against the float64 product, within f32's summation bound; a layer of a
stack read in place; and which products the cpp backend gives them."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ir import OPS
from ir.int8 import INT8_ACTIVATIONS
from ir.attention_ops import paged_attention_reference
from pallas_kernels.testing import random_paged_cache
from config.engine_config import EngineConfig
from runtime.worker import cpp_kernels, executor
from runtime.worker.kernels import (BF16_BITS, CPP_F32_MAX_ROWS, CPP_INT8_MAX_ROWS, CPP_INT8_WEIGHT_ONLY_MAX_ROWS,
                                    matmul_cpp, matmul_int8_cpp, paged_attention_xla)
from conftest import cpu_target_cases
from tolerances import KERNEL, SAME_MATH_F32

# (query heads, kv heads, head_dim, block_size, contexts): GQA 3:1 like SmolLM2, 4:1 at head_dim 128
# like Llama-3, MHA, and rows with no context at all (an empty slot).
SHAPES = [
    (9, 3, 64, 16, [101, 1, 16, 17, 300, 47, 0, 64, 5, 250, 33]),
    (8, 2, 128, 16, [1, 2, 15, 31, 129, 200]),
    (4, 4, 32, 32, [33, 95, 0, 7]),
    (6, 2, 16, 8, [1, 9, 64, 65, 3]),
]


def _decode_case(rng, heads, kvh, d, bs, ctx):
    k_pool, v_pool, tables, _ = random_paged_cache(rng, ctx, block_size=bs, num_kv_heads=kvh, head_dim=d,
                                                   dtype=jnp.float32, poison=True)
    s = len(ctx)
    q = jnp.asarray(rng.standard_normal((s, heads, d)), jnp.float32)
    cu = jnp.arange(s + 1, dtype=jnp.int32) - jnp.asarray([0] + list(np.cumsum(np.asarray(ctx) == 0)), jnp.int32)
    return q, jnp.asarray(k_pool), jnp.asarray(v_pool), tables, jnp.asarray(ctx, jnp.int32), cu


@pytest.mark.parametrize("heads,kvh,d,bs,ctx,cpu_target", cpu_target_cases(SHAPES, extra=SHAPES[:2]),
                         indirect=["cpu_target"])
def test_decode_rows_match_the_reference(heads, kvh, d, bs, ctx, cpu_target):
    """Decode rows (one new token each, its K/V already in the pool) through the kernel: the poisoned
    blocks and slots past each context are never read, and a row with no context gives zeros."""
    rng = np.random.default_rng(len(ctx) * 7 + d)
    q, kp, vp, tables, ctx_a, cu = _decode_case(rng, heads, kvh, d, bs, ctx)
    attrs = dict(scale=d ** -0.5, num_kv_heads=kvh, block_size=bs, head_dim=d)
    ref = paged_attention_reference(q, kp, vp, tables, ctx_a, cu, **attrs)
    got = jax.jit(lambda *a: paged_attention_xla(*a, **attrs, row_kernel=True))(q, kp, vp, tables, ctx_a, cu)
    live = np.asarray(ctx) > 0
    np.testing.assert_allclose(np.asarray(got)[:live.sum()], np.asarray(ref)[:live.sum()],
                               **KERNEL[jnp.dtype(jnp.float32)])
    assert np.all(np.isfinite(np.asarray(got)))


@pytest.mark.parametrize("heads,kvh,d,bs,ctx", SHAPES[:2])
def test_bf16_bits_match_the_reference_in_bf16(heads, kvh, d, bs, ctx):
    """Pools of bf16 bits (the CPU's bf16 KV cache) widen exactly: the same math as the reference
    over the bf16 pools."""
    rng = np.random.default_rng(len(ctx) + d)
    q, kp, vp, tables, ctx_a, cu = _decode_case(rng, heads, kvh, d, bs, ctx)
    kp, vp = (jnp.where(jnp.isfinite(x), x, 0.0).astype(jnp.bfloat16) for x in (kp, vp))
    attrs = dict(scale=d ** -0.5, num_kv_heads=kvh, block_size=bs, head_dim=d)
    ref = paged_attention_reference(q, kp, vp, tables, ctx_a, cu, **attrs)
    bits = lambda x: jax.lax.bitcast_convert_type(x, BF16_BITS)  # noqa: E731
    got = jax.jit(lambda *a: paged_attention_xla(*a, **attrs, row_kernel=True))(q, bits(kp), bits(vp), tables, ctx_a, cu)
    n = int(np.sum(np.asarray(ctx) > 0))
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(ref)[:n], **SAME_MATH_F32)


def _split_case(rng, ctx):
    """SmolLM2's heads over poisoned pools at contexts `ctx`: the reference's attention output, and
    state(part_tokens) -> the kernel's (max, denominator, accumulator) as numpy arrays."""
    q, kp, vp, tables, ctx_a, cu = _decode_case(rng, 9, 3, 64, 16, ctx)
    ref = paged_attention_reference(q, kp, vp, tables, ctx_a, cu, scale=0.125, num_kv_heads=3, block_size=16,
                                    head_dim=64)
    qf = (q * 0.125).reshape(len(ctx), 3, 3, 64)
    seq = jnp.arange(len(ctx), dtype=jnp.int32)

    def state(parts):
        f = jax.jit(lambda *a: cpp_kernels.paged_decode(*a, part_tokens=parts))
        return [np.asarray(x) for x in f(qf, kp, vp, tables, seq, ctx_a)]
    return ref, state


@pytest.mark.parametrize("part_tokens", [16, 48, cpp_kernels.PART_TOKENS])
@pytest.mark.parametrize("ctx", [[1000], [1, 517, 2], [250, 33, 4, 700]])
def test_long_rows_split_over_the_threads_match_the_reference(ctx, part_tokens):
    """A step of few rows splits each long row into parts of whole blocks, one per work item, and
    merges the parts' states: the merged state equals the unsplit walk's (part_tokens=0) and gives
    the reference's output, on contexts that stop off block boundaries, over poisoned pools."""
    ref, state = _split_case(np.random.default_rng(sum(ctx) + part_tokens), ctx)
    split, whole = state(part_tokens), state(0)
    for a, b in zip(split, whole):
        np.testing.assert_allclose(a, b, **SAME_MATH_F32)
    mx, den, acc = split
    assert np.all(np.isfinite(acc)) and np.all(den > 0)
    np.testing.assert_allclose((acc / den[..., None]).reshape(ref.shape), np.asarray(ref),
                               **KERNEL[jnp.dtype(jnp.float32)])


@pytest.mark.parametrize("ctx", [[20] * 15 + [1500], [1500] + [33] * 20 + [700, 0]])
def test_a_long_row_among_many_short_ones_is_split(ctx):
    """Steps of more rows than the threads want items: a row longer than an even share of the
    step's positions is still split (it would be one thread's whole walk), wherever it sits in the
    step, and the merged state equals the unsplit walk's and gives the reference's output. The
    long row's state differs from the unsplit one in the last bits (its sums ran in parts), which
    shows the split ran; the short rows' equal it bit for bit (they were not split)."""
    ref, state = _split_case(np.random.default_rng(len(ctx)), ctx)
    split, whole = state(16), state(0)
    long = np.asarray(ctx) >= 700
    for a, b in zip(split, whole):
        np.testing.assert_allclose(a, b, **SAME_MATH_F32)
        np.testing.assert_array_equal(a[~long], b[~long])
    assert not np.array_equal(split[2][long], whole[2][long])
    mx, den, acc = split
    n = int(np.sum(np.asarray(ctx) > 0))  # an empty row last, as the reference drops it
    np.testing.assert_allclose((acc[:n] / den[:n, ..., None]).reshape(n, 9, 64), np.asarray(ref)[:n],
                               **KERNEL[jnp.dtype(jnp.float32)])


def test_a_split_step_keeps_an_empty_row_empty():
    """A row with no context beside a long one: its state stays the empty one (max -1e30, zero
    denominator and accumulator) while the long row is split."""
    rng = np.random.default_rng(3)
    _, kp, vp, tables, _, _ = _decode_case(rng, 9, 3, 64, 16, [900, 1])
    qf = jnp.asarray(rng.standard_normal((2, 3, 3, 64)), jnp.float32)
    mx, den, acc = (np.asarray(x) for x in jax.jit(lambda *a: cpp_kernels.paged_decode(*a, part_tokens=16))(
        qf, kp, vp, tables, jnp.arange(2, dtype=jnp.int32), jnp.asarray([900, 0], jnp.int32)))
    assert np.all(mx[1] == -1e30) and not den[1].any() and not acc[1].any()
    assert np.all(den[0] > 0) and np.all(np.isfinite(acc[0]))


def _gathered(hlo: str) -> list[int]:
    """The element counts of the gathers in compiled HLO text."""
    sizes = []
    for ln in hlo.splitlines():
        if " gather(" in ln:
            dims = ln.split("=", 1)[1].split("[", 1)[1].split("]", 1)[0]
            sizes.append(int(np.prod([int(x) for x in dims.split(",") if x])))
    return sizes


def _walk_reference(qf, kp, vp, tables, seq, limit, start=None, softcap=None):
    """Each row's attention over its sequence's positions [start, limit) (start None: 0), scores
    capped by `softcap`, in float64 from the pools."""
    qf, kp, vp, tables = (np.asarray(x, np.float64) if x.dtype != np.int32 else np.asarray(x)
                          for x in (qf, kp, vp, tables))
    t, kvh, rep, d = qf.shape
    bs = kp.shape[1]
    out = np.zeros(qf.shape)
    for i in range(t):
        n = int(limit[i])
        if n == 0:
            continue
        pos = np.arange(0 if start is None else int(start[i]), n)
        blocks = tables[int(seq[i]), pos // bs]
        k, v = kp[blocks, pos % bs], vp[blocks, pos % bs]  # [n, kvh, d]
        scores = np.einsum("hrd,nhd->hrn", qf[i], k)
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out[i] = np.einsum("hrn,nhd->hrd", w / w.sum(-1, keepdims=True), v)
    return out


# (query heads, kv heads, head_dim, block size, [(prior context, new tokens) per sequence]): a
# prefill step's rows, each prompt's tokens in a row after another, beside decode rows.
PROMPT_STEPS = [
    (9, 3, 64, 16, [(0, 37), (45, 20), (7, 1), (0, 8), (130, 3)]),  # SmolLM2: fresh, chunked, decode
    (8, 2, 128, 16, [(0, 19), (31, 17), (200, 1)]),                  # Llama-3's head_dim
    (4, 4, 32, 32, [(0, 64), (5, 2), (64, 33)]),                     # MHA, blocks of 32
]


@pytest.mark.parametrize("heads,kvh,d,bs,seqs,bf16,cpu_target", cpu_target_cases(
    [(*p, bf16) for p in PROMPT_STEPS for bf16 in (False, True)], extra=[(*PROMPT_STEPS[0], True)]),
    indirect=["cpu_target"])
def test_prompt_rows_walk_together(heads, kvh, d, bs, seqs, bf16, cpu_target):
    """A prompt's consecutive rows walk its blocks together (group_rows, GroupWalk): over poisoned
    pools, with prompts off block boundaries, continuations over earlier context, decode rows and a
    padding row in the same step, the state gives float64's attention within the kernel bar, the
    same as each row alone (group_rows=1) within f32's, and never reads past a row's positions.
    The prompts' rows differ from the rows alone in the last bits (their sums ran in another
    order), which shows the groups ran; a decode row (a group of one) equals its walk alone."""
    rng = np.random.default_rng(d + len(seqs) + bf16)
    ctx = [p + n for p, n in seqs]
    k_pool, v_pool, tables, _ = random_paged_cache(rng, ctx, block_size=bs, num_kv_heads=kvh, head_dim=d,
                                                   dtype=jnp.float32, poison=True)
    seq = np.concatenate([np.full(n, i) for i, (_, n) in enumerate(seqs)] + [[0]]).astype(np.int32)
    limit = np.concatenate([np.arange(p + 1, p + n + 1) for p, n in seqs] + [[0]]).astype(np.int32)  # padding row
    qf = rng.standard_normal((len(seq), kvh, heads // kvh, d)).astype(np.float32) * d ** -0.5
    kp, vp = np.asarray(k_pool), np.asarray(v_pool)
    if bf16:  # the CPU's bf16 KV cache: the kernel widens the bits exactly
        kp, vp = (np.asarray(jnp.asarray(np.where(np.isfinite(x), x, 0.0)).astype(jnp.bfloat16)) for x in (kp, vp))
        pools = tuple(jax.lax.bitcast_convert_type(jnp.asarray(x), BF16_BITS) for x in (kp, vp))
        kp, vp = (np.asarray(jnp.asarray(x).astype(jnp.float32)) for x in (kp, vp))
    else:
        pools = (jnp.asarray(kp), jnp.asarray(vp))

    def state(group_rows):
        f = jax.jit(lambda *a: cpp_kernels.paged_decode(*a, part_tokens=0, group_rows=group_rows))
        return [np.asarray(x) for x in f(jnp.asarray(qf), *pools, tables, jnp.asarray(seq), jnp.asarray(limit))]

    grouped, alone = state(cpp_kernels.GROUP_ROWS), state(1)
    mx, den, acc = grouped
    live = limit > 0
    assert np.all(np.isfinite(acc)) and np.all(den[live] > 0) and not acc[~live].any()
    want = _walk_reference(qf, kp, vp, tables, seq, limit)
    np.testing.assert_allclose(acc[live] / den[live][..., None], want[live], **KERNEL[jnp.dtype(jnp.float32)])
    for a, b in zip(grouped, alone):
        np.testing.assert_allclose(a, b, **SAME_MATH_F32)
    prompt = np.isin(seq, [i for i, (_, n) in enumerate(seqs) if n > 1]) & live
    decode = np.isin(seq, [i for i, (_, n) in enumerate(seqs) if n == 1]) & live
    assert not np.array_equal(grouped[2][prompt], alone[2][prompt])
    np.testing.assert_array_equal(grouped[2][decode], alone[2][decode])


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("group_rows,part_tokens", [(cpp_kernels.GROUP_ROWS, 0), (1, 16)])
def test_rows_start_at_their_window(window, group_rows, part_tokens):
    """Rows that see [start, limit) (a sliding window, softcapped): prompt rows walking together,
    whose windows start in different blocks (a window shorter than a block leaves early rows no
    position in later blocks), and rows alone split into parts. Blocks wholly before a row's start
    hold NaN and are never read."""
    rng = np.random.default_rng(window)
    seqs = [(0, 37), (45, 20), (130, 1), (7, 1)]
    ctx = [p + n for p, n in seqs]
    kp, vp, tables, _ = random_paged_cache(rng, ctx, block_size=16, num_kv_heads=2, head_dim=64,
                                           dtype=jnp.float32, poison=True)
    kp, vp, tab = np.array(kp), np.array(vp), np.asarray(tables)
    seq = np.concatenate([np.full(n, i) for i, (_, n) in enumerate(seqs)]).astype(np.int32)
    limit = np.concatenate([np.arange(p + 1, p + n + 1) for p, n in seqs]).astype(np.int32)
    start = np.maximum(limit - window, 0).astype(np.int32)
    for s in range(len(seqs)):  # the blocks before every row's start of the sequence: NaN
        first = start[seq == s].min() // 16
        kp[tab[s, :first]] = np.nan
        vp[tab[s, :first]] = np.nan
    qf = rng.standard_normal((len(seq), 2, 3, 64)).astype(np.float32) * 0.5
    f = jax.jit(lambda *a: cpp_kernels.paged_decode(*a[:6], part_tokens=part_tokens, group_rows=group_rows,
                                                    start=a[6], softcap=2.5))
    mx, den, acc = (np.asarray(x) for x in f(jnp.asarray(qf), jnp.asarray(kp), jnp.asarray(vp), tables,
                                             jnp.asarray(seq), jnp.asarray(limit), jnp.asarray(start)))
    assert np.all(np.isfinite(acc)) and np.all(den > 0)
    want = _walk_reference(qf, np.nan_to_num(kp), np.nan_to_num(vp), tables, seq, limit, start, softcap=2.5)
    np.testing.assert_allclose(acc / den[..., None], want, **KERNEL[jnp.dtype(jnp.float32)])


def test_the_kernel_reads_the_pool_in_place():
    """The compiled decode call gathers no K/V and copies no pool: the pools reach the kernel as
    the buffers themselves (the XLA lowering gathers each row's context into a fresh array)."""
    rng = np.random.default_rng(0)
    q, kp, vp, tables, ctx, cu = _decode_case(rng, 9, 3, 64, 16, [40, 70, 3])
    attrs = dict(scale=0.125, num_kv_heads=3, block_size=16, head_dim=64)

    def hlo(row_kernel):
        f = jax.jit(lambda *a: paged_attention_xla(*a, **attrs, row_kernel=row_kernel))
        return f.lower(q, kp, vp, tables, ctx, cu).compile().as_text()

    one_block = 16 * 64  # one block of one kv head
    xla, cpp = hlo(False), hlo(True)
    assert max(_gathered(xla)) >= one_block  # the check can fail: the XLA lowering gathers K/V
    assert max(_gathered(cpp), default=0) < one_block and cpp_kernels.PAGED_DECODE_TARGET in cpp
    pool = "f32[" + ",".join(map(str, kp.shape)) + "]"
    assert not [ln for ln in cpp.splitlines() if " copy(" in ln and ln.split("=", 1)[1].strip().startswith(pool)]


def test_auto_takes_the_kernel_here_and_xla_without_a_compiler(monkeypatch, tmp_path):
    assert executor.resolve_backend("auto") == "cpp"  # CPU, with g++: the kernel builds
    # A compiler that fails: the build says why, `cpp` refuses, `auto` falls back to plain XLA.
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(cpp_kernels.KernelUnavailable, match="false"):
        cpp_kernels._build()
    monkeypatch.setattr(cpp_kernels, "_library_for", lambda target: "no C++ compiler (set CXX, or install g++)")
    cpp_kernels._available.cache_clear()
    try:
        assert executor.resolve_backend("auto") == "xla"
        with pytest.raises(cpp_kernels.KernelUnavailable, match="no C\\+\\+ compiler"):
            executor.resolve_backend("cpp")
    finally:
        cpp_kernels._available.cache_clear()


def test_tensor_parallel_steps_keep_the_xla_walk():
    """The FFI call has no partitioning rule: under TP, XLA would all-gather the pools to run it
    (test_shard checks the collectives of a TP step), so `auto` takes XLA and `cpp` says why not."""
    assert executor.resolve_backend("auto", sharded=True) == "xla"
    with pytest.raises(ValueError, match="tensor parallelism"):
        executor.resolve_backend("cpp", sharded=True)


def test_loading_the_kernel_keeps_subnormal_floats(monkeypatch, tmp_path):
    """A library linked with -ffast-math turns on flush-to-zero for the whole process when it is
    loaded (gcc's crtfastmath.o): numpy's subnormals would read as 0 from then on, and so did the
    schemathesis test's float strategies. (XLA:CPU flushes subnormals inside its own steps anyway.)"""
    import subprocess
    import sys

    lib = cpp_kernels._build()  # the cached build; loaded afresh in a process that never had it
    code = ("import ctypes, sys, numpy as np; tiny = np.float32(1e-38); assert tiny / np.float32(100) > 0; "
            "ctypes.CDLL(sys.argv[1]); assert tiny / np.float32(100) > 0, 'flush-to-zero after loading'")
    r = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]  # 1e-40 is subnormal in f32


@pytest.mark.slow  # a whole build (about a minute on 2 cores); the fast loop's first kernel use builds once
def test_a_fresh_cache_builds_a_library_that_loads(monkeypatch, tmp_path):
    """The build step on its own, into an empty cache: one .so, keyed so a second call reuses it."""
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    lib = cpp_kernels._build()
    assert lib.parent == tmp_path and lib.suffix == ".so" and lib.stat().st_size > 0
    assert cpp_kernels._build() == lib and sorted(p.name for p in tmp_path.iterdir()) == [".build.lock", lib.name]


def test_processes_starting_at_once_build_the_kernels_once(monkeypatch, tmp_path):
    """Two test workers on an empty cache: the second waits on the lock, then loads the first's build."""
    import threading

    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    builds, results = [], []
    started = threading.Event()

    def fake_compile(lib, cxx, include, flags):
        builds.append(lib)
        started.set()
        threading.Event().wait(0.5)  # the build takes a while; the other caller arrives meanwhile
        lib.write_bytes(b"built")
        return lib

    monkeypatch.setattr(cpp_kernels, "_compile_into", fake_compile)
    first = threading.Thread(target=lambda: results.append(cpp_kernels._build()))
    first.start()
    started.wait(10)
    results.append(cpp_kernels._build())
    first.join()
    assert len(builds) == 1 and results[0] == results[1] == builds[0]


# (rows, K, N): SmolLM2's decode products (q/k/v, down, gate/up, the head's width), an odd K (a last
# weight row without a partner), N off the 64-column tiles (the scalar tail), narrow N with a long K
# (split over threads by K, the shares summed), wide N (column chunks), tiny shapes.
INT8_SHAPES = [(1, 576, 960), (4, 1536, 576), (2, 576, 3072), (3, 577, 1000), (1, 9000, 70),
               (4, 64, 4100), (7, 130, 2049), (5, 33, 7), (1, 1, 1)]


# The extra targets' cases: their scalar loops (x86-64-v3) and AVX-512BW paths without VNNI (v4).
EXTRA_INT8_SHAPES = [(1, 576, 960), (3, 577, 1000), (5, 33, 7)]


@pytest.mark.parametrize("m,k,n,cpu_target", cpu_target_cases(INT8_SHAPES, extra=EXTRA_INT8_SHAPES),
                         indirect=["cpu_target"])
def test_int8_matmul_equals_xla_bit_for_bit(m, k, n, cpu_target):
    """Exact int32 sums, so exactly XLA's dot, at every shape and at the int8 extremes (-128 too)."""
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    x = rng.integers(-128, 128, (m, k), dtype=np.int8)
    w = rng.integers(-128, 128, (k, n), dtype=np.int8)
    x[0, : k // 2] = -128  # the largest products, in one row's sum
    w[: k // 2, 0] = -128
    got = jax.jit(cpp_kernels.int8_matmul)(jnp.asarray(x), jnp.asarray(w))
    want = jax.lax.dot(jnp.asarray(x), jnp.asarray(w), preferred_element_type=jnp.int32)
    assert got.dtype == jnp.int32 and got.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got), x.astype(np.int64) @ w.astype(np.int64))


@pytest.mark.parametrize("m,k,n,cpu_target", cpu_target_cases(INT8_SHAPES, extra=EXTRA_INT8_SHAPES),
                         indirect=["cpu_target"])
def test_int8_weight_matmul_is_the_f32_product_of_the_widened_weights(m, k, n, cpu_target):
    """Weight-only: f32 rows times int8 weights, within the error bound of a k-term f32 sum
    (k * 2^-24 of sum |x| |w|) of the exact float64 product, at every shape."""
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.integers(-128, 128, (k, n), dtype=np.int8)
    got = jax.jit(cpp_kernels.int8_weight_matmul)(jnp.asarray(x), jnp.asarray(w))
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    bound = k * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64))
    assert np.all(np.abs(np.asarray(got, np.float64) - x64 @ w64) <= bound)


@pytest.mark.parametrize("m,k,n,cpu_target", cpu_target_cases(INT8_SHAPES + [(8, 576, 960), (6, 1536, 576)],
                                                            extra=EXTRA_INT8_SHAPES), indirect=["cpu_target"])
def test_f32_matmul_is_the_f32_product(m, k, n, cpu_target):
    """f32 rows times f32 weights, within the error bound of a k-term f32 sum of the exact float64
    product, at every shape (the int8 shapes' tails and splits, and the 8-row decode bucket)."""
    rng = np.random.default_rng(m * 7919 + k * 31 + n + 1)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    got = jax.jit(cpp_kernels.f32_matmul)(jnp.asarray(x), jnp.asarray(w))
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    bound = k * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64))
    assert np.all(np.abs(np.asarray(got, np.float64) - x64 @ w64) <= bound)


def test_calls_from_several_threads_at_once_give_each_its_own_result():
    """The kernels' helper threads serve one call at a time (cpp/parallel_for.h); calls made at once
    from several threads, some sharing the helpers and some running alone, each get the result a
    call made alone gets (bit for bit: every output is summed by one thread in k order)."""
    import threading

    rng = np.random.default_rng(5)
    product = jax.jit(cpp_kernels.f32_matmul)
    cases = [(jnp.asarray(rng.standard_normal((m, 576)), jnp.float32),
              jnp.asarray(rng.standard_normal((576, n)), jnp.float32)) for m, n in [(1, 960), (3, 3072), (8, 576), (2, 1536)]]
    alone = [np.asarray(product(x, w)) for x, w in cases]
    failures, start = [], threading.Barrier(len(cases))

    def caller(i):
        start.wait()
        for _ in range(40):
            got = np.asarray(product(*cases[i]))
            if not np.array_equal(got, alone[i]):
                failures.append((i, float(np.max(np.abs(got - alone[i])))))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


POLL_CHILD = """
import sys, numpy as np, jax, jax.numpy as jnp
from runtime.worker import cpp_kernels
rng = np.random.default_rng(6)
worst = 0.0
for m, k, n in [(1, 576, 960), (3, 577, 1000), (8, 1536, 576)]:
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    for _ in range(30):  # with a poll of 0 the helpers sleep between calls: each call wakes them
        got = np.asarray(cpp_kernels.f32_matmul(jnp.asarray(x), jnp.asarray(w)))
        worst = max(worst, float(np.abs(got - x.astype(np.float64) @ w).max()))
print(cpp_kernels.helper_poll_us(), worst)
"""


def test_helper_poll_setting(monkeypatch):
    """JAXSERVE_CPU_POLL_US: a poll of 0 (helpers sleep after every call, and each call wakes them)
    gives the products the reference gives; a value that is no whole number of microseconds in range
    is one clear error when the kernels load, not a silent default."""
    import os
    import subprocess
    import sys

    assert cpp_kernels.helper_poll_us() == cpp_kernels.cpu_poll_us()  # this process's (300 unless set)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "JAXSERVE_CPU_POLL_US": "0", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", POLL_CHILD], env=env, capture_output=True, text=True,
                         timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    poll, worst = out.stdout.split()[-2:]
    assert poll == "0" and float(worst) < 1e-3, out.stdout
    said = "JAXSERVE_CPU_POLL_US must be a whole number of microseconds from 0 to 1,000,000; got {!r}"
    for good, us in (("", 300), ("0", 0), ("1000000", 1_000_000)):
        monkeypatch.setenv("JAXSERVE_CPU_POLL_US", good)
        assert cpp_kernels.cpu_poll_us() == us
    for bad in ("-1", "300us", "1000001", "\u00b3"):
        monkeypatch.setenv("JAXSERVE_CPU_POLL_US", bad)
        with pytest.raises(cpp_kernels.BadCpuTarget) as e:
            cpp_kernels.cpu_poll_us()
        assert str(e.value) == said.format(bad)
    env["JAXSERVE_CPU_POLL_US"] = "300us"  # in a process that loads the kernels: refused, not ignored
    out = subprocess.run([sys.executable, "-c", "from runtime.worker import cpp_kernels; cpp_kernels.ensure()"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode != 0 and said.format("300us") in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (3, 577, 1000), (4, 1536, 576)])
def test_products_take_a_layer_of_a_stack_where_it_lies(m, k, n):
    """A stack w [L, K, N] and a layer index (traced, as in a scanned step): each layer's product is
    exactly the product with that layer's [K, N] slice, for every kernel; a layer outside the stack
    is an error, not a read past it."""
    rng = np.random.default_rng(m + k + n)
    stacks = {"i8": jnp.asarray(rng.integers(-128, 128, (3, k, n), dtype=np.int8)),
              "f32": jnp.asarray(rng.standard_normal((3, k, n)), jnp.float32)}
    xf = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    rows = {cpp_kernels.int8_matmul: (jnp.asarray(rng.integers(-128, 128, (m, k), dtype=np.int8)), stacks["i8"]),
            cpp_kernels.int8_weight_matmul: (xf, stacks["i8"]), cpp_kernels.f32_matmul: (xf, stacks["f32"])}
    for product, (x, stack) in rows.items():
        at = jax.jit(lambda x, w, layer: product(x, w, layer))
        for layer in range(3):
            np.testing.assert_array_equal(np.asarray(at(x, stack, jnp.int32(layer))),
                                          np.asarray(jax.jit(product)(x, stack[layer])))
        for layer in (3, -1):
            with pytest.raises(Exception, match=f"layer {layer} of 3"):
                at(x, stack, jnp.int32(layer)).block_until_ready()
        with pytest.raises(ValueError, match="layer index"):
            product(x, stack)


def _takes_kernel(activations, rows, dtype):
    if not cpp_kernels.matmul_vectorized():
        return None
    if activations == INT8_ACTIVATIONS:
        return cpp_kernels.INT8_MATMUL_TARGET if rows <= CPP_INT8_MAX_ROWS else None
    if dtype == jnp.float32 and rows <= CPP_INT8_WEIGHT_ONLY_MAX_ROWS:
        return cpp_kernels.INT8_WEIGHT_MATMUL_TARGET
    return None


@pytest.mark.parametrize("rows", [1, 5, CPP_F32_MAX_ROWS, CPP_F32_MAX_ROWS + 1])
@pytest.mark.parametrize("scanned", [False, True])
def test_f32_products_of_few_rows_take_the_kernel(rows, scanned):
    """Under kernel_backend="cpp", where the kernel has its vector path: an f32 product of at most
    CPP_F32_MAX_ROWS rows (leading dims flattened) calls f32_matmul, and with a stack and a layer
    reads that layer in place (no slice of the stack in the compiled HLO); wider products, and the
    tied head's transposed product, keep ir.ops's lowering (on the layer's slice). All give ir.ops's
    result up to f32 summation order."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((1, rows, 576)), jnp.float32)
    stack = jnp.asarray(rng.standard_normal((3, 576, 960)), jnp.float32)
    if scanned:
        f = jax.jit(lambda x, w, layer: matmul_cpp(x, w, layer=layer))
        args, w = (x, stack, jnp.int32(2)), stack[2]
    else:
        f = jax.jit(lambda x, w: matmul_cpp(x, w))
        args, w = (x, stack[2]), stack[2]
    hlo = f.lower(*args).compile().as_text()
    kernel = cpp_kernels.matmul_vectorized() and rows <= CPP_F32_MAX_ROWS
    assert (cpp_kernels.F32_MATMUL_TARGET in hlo) == kernel
    if scanned:
        assert ("dynamic-slice" in hlo) == (not kernel)
    got, ref = np.asarray(f(*args)), np.asarray(OPS["matmul"].impl(x, w))
    assert got.shape == (1, rows, 960)
    bound = 2 * 576 * 2.0 ** -24 * (np.abs(np.asarray(x)) @ np.abs(np.asarray(w)))
    assert np.all(np.abs(got - ref) <= bound)
    head = jax.jit(lambda x, e: matmul_cpp(x, e, transpose_b=True))
    assert cpp_kernels.F32_MATMUL_TARGET not in head.lower(x, w.T).compile().as_text()


@pytest.mark.parametrize("rows", [1, 3, CPP_INT8_MAX_ROWS, CPP_INT8_MAX_ROWS + 1, CPP_INT8_WEIGHT_ONLY_MAX_ROWS,
                                  CPP_INT8_WEIGHT_ONLY_MAX_ROWS + 1])
@pytest.mark.parametrize("activations", [INT8_ACTIVATIONS, None])
def test_int8_products_of_few_rows_take_the_kernels(rows, activations):
    """Under kernel_backend="cpp", where the kernels have their vector paths: a W8A8 product of at
    most CPP_INT8_MAX_ROWS rows calls int8_matmul and gives exactly ir.ops's result; a weight-only
    product of f32 rows, at most CPP_INT8_WEIGHT_ONLY_MAX_ROWS, calls int8_weight_matmul and gives
    ir.ops's result up to f32 summation order. Wider products keep ir.ops's lowering."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 576)), jnp.float32)
    w = jnp.asarray(rng.integers(-127, 128, (576, 960), dtype=np.int8))
    scale = jnp.asarray(rng.uniform(1e-3, 2e-2, 960), jnp.float32)
    f = jax.jit(lambda x, w, s: matmul_int8_cpp(x, w, s, activations=activations))
    hlo = f.lower(x, w, scale).compile().as_text()
    target = _takes_kernel(activations, rows, x.dtype)
    for name in (cpp_kernels.INT8_MATMUL_TARGET, cpp_kernels.INT8_WEIGHT_MATMUL_TARGET):
        assert (name in hlo) == (name == target), name
    got, ref = np.asarray(f(x, w, scale)), np.asarray(OPS["matmul_int8"].impl(x, w, scale, activations=activations))
    if activations == INT8_ACTIVATIONS or target is None:
        np.testing.assert_array_equal(got, ref)
    else:
        # Two f32 sums of 576 terms in different orders: each within 576 * 2^-24 of sum |x| |w| * scale.
        bound = 2 * 576 * 2.0 ** -24 * (np.abs(np.asarray(x)) @ np.abs(np.asarray(w, np.float32))) * np.asarray(scale)
        assert np.all(np.abs(got - ref) <= bound)


def test_weight_only_bf16_rows_keep_xla():
    """The weight-only kernel takes f32 rows only; a bf16 plan's products stay in XLA."""
    x = jnp.ones((1, 64), jnp.bfloat16)
    w = jnp.ones((64, 128), jnp.int8)
    f = jax.jit(lambda x, w, s: matmul_int8_cpp(x, w, s))
    hlo = f.lower(x, w, jnp.ones(128, jnp.float32)).compile().as_text()
    assert cpp_kernels.INT8_WEIGHT_MATMUL_TARGET not in hlo
    assert f(x, w, jnp.ones(128, jnp.float32)).dtype == jnp.bfloat16


def test_cpu_target_setting(monkeypatch, tmp_path, caplog):
    """JAXSERVE_CPU_TARGET: an unknown value is one clear error naming the choices; `none` and a
    target this CPU cannot run build nothing, and `auto` falls back to XLA with one log line that
    says why; the target is part of the cache key and of the FFI names; each named target has the
    vector paths its instructions allow (the x86 builds, where this CPU runs them)."""
    import logging
    import platform

    monkeypatch.setenv("JAXSERVE_CPU_TARGET", "avx9")
    with pytest.raises(cpp_kernels.BadCpuTarget, match="must be one of native, x86-64-v3, x86-64-v4, "
                       "x86-64-v4-amx, none; got 'avx9'"):
        executor.resolve_backend("auto")
    monkeypatch.setenv("JAXSERVE_CPU_TARGET", "none")
    with caplog.at_level(logging.WARNING, logger=cpp_kernels.__name__):
        assert executor.resolve_backend("auto") == "xla"
        assert executor.resolve_backend("auto") == "xla"
    said = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(said) == 1 and "JAXSERVE_CPU_TARGET=none" in said[0] and "XLA" in said[0], said
    assert not any(cpp_kernels.paths().values())
    with pytest.raises(cpp_kernels.KernelUnavailable, match="none: no C\\+\\+ kernels"):
        executor.resolve_backend("cpp")
    # A CPU without the target's features (here: one that reports no AVX-512) builds nothing.
    monkeypatch.setattr(cpp_kernels, "_cpu_flags", lambda: {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
    if platform.machine() == "x86_64":
        with pytest.raises(cpp_kernels.KernelUnavailable, match="x86-64-v4 needs avx512f, avx512bw"):
            cpp_kernels._build("x86-64-v4")
        assert cpp_kernels._target_flags("x86-64-v3")[-1] == "-march=x86-64-v3"
    monkeypatch.undo()
    # The cache key and the FFI names follow the target.
    monkeypatch.setattr(cpp_kernels, "_compile_into", lambda lib, *a: lib)
    monkeypatch.setattr(cpp_kernels, "_target_flags", lambda t: (*cpp_kernels.FLAGS, *cpp_kernels.CPU_TARGETS[t]))
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    libs = {t: cpp_kernels._build(t) for t in ("native", "x86-64-v3", "x86-64-v4", "x86-64-v4-amx")}
    assert len(set(libs.values())) == 4
    assert cpp_kernels.ffi_name("jaxserve_f32_matmul", "x86-64-v3") == "jaxserve_f32_matmul_x86_64_v3"
    assert cpp_kernels.ffi_name("jaxserve_f32_matmul", "native") == "jaxserve_f32_matmul"
    monkeypatch.undo()
    want = {"x86-64-v3": dict(matmul_avx512bw=False, gguf_blocks=True, gguf_tiles_q8=True, gguf_tiles_f32=True,
                              gguf_tiles_amx_bf16=False),
            "x86-64-v4": dict(matmul_avx512bw=True, gguf_blocks=True, gguf_tiles_q8=True, gguf_tiles_f32=True,
                              gguf_tiles_amx_bf16=False)}
    for target, paths in want.items():
        try:
            cpp_kernels._target_flags(target)
        except cpp_kernels.KernelUnavailable:
            continue  # this CPU cannot run it
        monkeypatch.setenv("JAXSERVE_CPU_TARGET", target)
        assert cpp_kernels.paths() == dict(paged_decode=True, **paths), target
        # f32 tiles take every step's product on both (AVX2: wide steps over widened slices of a
        # tile), so that they stand alone, with no f32 weight beside them.
        assert cpp_kernels.tiles_max_rows("f32") == cpp_kernels.EVERY_STEP, target
        assert executor.tiles_in_kernel(EngineConfig(kernel_backend="cpp")), target
        assert executor.tile_activations(EngineConfig(kernel_backend="cpp")) == "f32", target


def test_env_report_shows_the_target_and_its_paths(monkeypatch, tmp_path):
    from runtime.tools import collect_env

    monkeypatch.setenv("JAXSERVE_CPU_TARGET", "none")
    report = collect_env.format_report(collect_env.collect())
    assert "JAXSERVE_CPU_TARGET=none" in report and "none live (XLA's lowerings only)" in report
    monkeypatch.delenv("JAXSERVE_CPU_TARGET")
    cpp_kernels.ensure()
    info = collect_env.collect()["cpu_kernels"]
    assert info["target"] == "native" and info["paths"] == cpp_kernels.paths() and info["paths"]["paged_decode"]
    assert "gguf_blocks          live" in collect_env.format_report(collect_env.collect())
    # A target not built yet is reported as such, and not compiled by the report.
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    info = collect_env.collect()["cpu_kernels"]
    assert info["built"] is False and "paths" not in info and not list(tmp_path.glob("*.so"))


# ------------------------------------------------- the standalone check (cpp/check_kernels.cc)

_FFI_DTYPES = {np.dtype(np.int8): 2, np.dtype(np.int32): 4, np.dtype(np.uint8): 6, np.dtype(np.float32): 11}
CHECK_SOURCE = cpp_kernels.SOURCES[0].with_name("check_kernels.cc")


def _check_cases() -> bytes:
    """Cases for cpp/check_kernels.cc: every kernel's FFI entry point on ragged shapes, with its
    plain reference (numpy, float64): decode attention's state over poisoned pools (prompt rows
    walking together, rows split into parts, windows, a softcap), the int8, weight-only and f32
    products, and GGUF blocks in the file's rows and in tiles (q8 and f32 activations), plain and
    from a layer stack."""
    import struct

    from ir.blocks import BLOCK_FORMATS, KEPT_FORMATS, pack_tiles, round_q8
    from test_gguf_blocks import _quantized

    out, count = [b"JXCK", b""], 0

    def s(text):
        return struct.pack("<I", len(text)) + text.encode()

    def buf(a):
        a = np.ascontiguousarray(a)
        return (struct.pack("<iI", _FFI_DTYPES[a.dtype], a.ndim) + struct.pack(f"<{a.ndim}q", *a.shape)
                + struct.pack("<Q", a.nbytes) + a.tobytes())

    def case(name, handler, args, attrs, rets):
        nonlocal count
        count += 1
        body = s(name) + s(handler) + struct.pack("<I", len(args)) + b"".join(buf(a) for a in args)
        body += struct.pack("<I", len(attrs))
        for key in sorted(attrs):
            v = attrs[key]
            body += s(key) + (struct.pack("<iq", 5, v) if isinstance(v, int) else struct.pack("<if4x", 11, v))
        body += struct.pack("<I", len(rets))
        for want, atol, rtol in rets:
            body += buf(want) + struct.pack("<dd", atol, rtol)
        out.append(body)

    rng = np.random.default_rng(53)
    layer0 = np.zeros((), np.int32)

    def f32_bound(x, w):  # a k-term f32 sum's error bound, per element
        k = x.shape[1]
        return (k * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)))).max() + 1e-30

    for fmt, spec in BLOCK_FORMATS.items():
        for m, k, n in [(1, 64, 17), (3, 96, 50), (5, 128, 64), (11, 576, 7)]:
            blocks, values = _quantized(rng.standard_normal((n, k)) * 0.1, fmt)
            x = rng.standard_normal((m, k)).astype(np.float32)
            want = x.astype(np.float64) @ values.T.astype(np.float64)
            case(f"block_matmul {fmt} rows {m}x{k}x{n}", "JaxserveBlockMatmul", [x, blocks, layer0],
                 dict(format=spec.type_id, layout=0), [(want.astype(np.float32), 1e-5 * np.abs(want).max(), 1e-5)])
        stack = [_quantized(rng.standard_normal((32, 96)) * 0.1, fmt) for _ in range(3)]
        x = rng.standard_normal((4, 96)).astype(np.float32)
        want = x.astype(np.float64) @ stack[2][1].T.astype(np.float64)
        case(f"block_matmul {fmt} layer 2 of 3", "JaxserveBlockMatmul", [x, np.stack([b for b, _ in stack]),
             np.int32(2)], dict(format=spec.type_id, layout=0),
             [(want.astype(np.float32), 1e-5 * np.abs(want).max(), 1e-5)])
        for m, k, n in [(3, 64, 48), (13, 160, 64), (33, 96, 16)]:
            blocks, values = _quantized(rng.standard_normal((n, k)) * 0.1, fmt)
            x = rng.standard_normal((m, k)).astype(np.float32)
            for layout, xs in ((1, np.asarray(round_q8(jnp.asarray(x)))), (2, x)):
                want = xs.astype(np.float64) @ values.T.astype(np.float64)
                case(f"tiles {fmt} {'q8' if layout == 1 else 'f32'} {m}x{k}x{n}", "JaxserveBlockMatmul",
                     [x, pack_tiles(blocks, fmt), layer0], dict(format=spec.type_id, layout=layout),
                     [(want.astype(np.float32), 1e-5 * np.abs(want).max(), 1e-5)])
    # The K-quants, in tiles only: Q4_K's and Q5_K's records keep f32 scales (the other formats' keep
    # the file's f16s), Q6_K's two int8 scales per block; 3 rows (the short rows' path) and 9.
    from test_gguf_k_quants import k_quant_rows

    for fmt in ("q4_k", "q5_k", "q6_k"):
        if fmt == "q4_k":
            blocks, values = _quantized(rng.standard_normal((32, 512)) * 0.1, "q4_k")
        else:
            blocks, values = k_quant_rows(rng, fmt, 32, 512, 0.1)
        for m in (3, 9):
            x = rng.standard_normal((m, 512)).astype(np.float32)
            for layout, xs in ((1, np.asarray(round_q8(jnp.asarray(x)))), (2, x)):
                want = xs.astype(np.float64) @ values.T.astype(np.float64)
                case(f"tiles {fmt} {'q8' if layout == 1 else 'f32'} {m}x512x32", "JaxserveBlockMatmul",
                     [x, pack_tiles(blocks, fmt), layer0], dict(format=KEPT_FORMATS[fmt].type_id, layout=layout),
                     [(want.astype(np.float32), 1e-5 * np.abs(want).max(), 1e-5)])
    for m, k, n in [(1, 576, 960), (3, 577, 100), (5, 33, 7), (8, 130, 2049)]:
        xi, wi = rng.integers(-128, 128, (m, k), dtype=np.int8), rng.integers(-128, 128, (k, n), dtype=np.int8)
        case(f"int8_matmul {m}x{k}x{n}", "JaxserveInt8Matmul", [xi, wi, layer0], {},
             [((xi.astype(np.int64) @ wi.astype(np.int64)).astype(np.int32), 0.0, 0.0)])
        x = rng.standard_normal((m, k)).astype(np.float32)
        case(f"int8_weight_matmul {m}x{k}x{n}", "JaxserveInt8WeightMatmul", [x, wi, layer0], {},
             [((x.astype(np.float64) @ wi).astype(np.float32), f32_bound(x, wi), 0.0)])
        w = rng.standard_normal((k, n)).astype(np.float32)
        case(f"f32_matmul {m}x{k}x{n}", "JaxserveF32Matmul", [x, w, layer0], {},
             [((x.astype(np.float64) @ w).astype(np.float32), f32_bound(x, w), 0.0)])
    # Decode attention: prompt rows, decode rows and a padding row over poisoned pools.
    for (kvh, rep, d, bs, seqs), window, softcap, parts, group in [
            ((3, 3, 64, 16, [(0, 37), (45, 20), (7, 1), (130, 1)]), None, None, 0, cpp_kernels.GROUP_ROWS),
            ((2, 4, 128, 16, [(0, 19), (300, 1)]), None, None, 16, 1),
            ((2, 3, 32, 8, [(0, 21), (60, 1), (5, 1)]), 17, 2.5, 0, cpp_kernels.GROUP_ROWS)]:
        ctx = [p + t for p, t in seqs]
        kp, vp, tables, _ = random_paged_cache(rng, ctx, block_size=bs, num_kv_heads=kvh, head_dim=d,
                                               dtype=jnp.float32, poison=True)
        kp, vp, tables = np.asarray(kp), np.asarray(vp), np.asarray(tables)
        seq = np.concatenate([np.full(t, i) for i, (_, t) in enumerate(seqs)] + [[0]]).astype(np.int32)
        limit = np.concatenate([np.arange(p + 1, p + t + 1) for p, t in seqs] + [[0]]).astype(np.int32)
        start = np.zeros_like(limit) if window is None else np.maximum(limit - window, 0).astype(np.int32)
        qf = (rng.standard_normal((len(seq), kvh, rep, d)) * d ** -0.5).astype(np.float32)
        mx, den, acc = _walk_state(qf, kp, vp, tables, seq, limit, start, softcap)
        scale = np.abs(acc).max()
        case(f"paged_decode kvh {kvh} rep {rep} d {d} bs {bs}{' window' if window else ''}", "JaxservePagedDecode",
             [qf, kp, vp, tables, seq, limit, start],
             dict(part_tokens=parts, group_rows=group, softcap=float(softcap or 0.0)),
             [(mx, 1e-5, 1e-5), (den, 1e-5, 1e-4), (acc, 1e-4 * scale, 1e-4)])
    out[1] = np.uint32(count).tobytes()
    return b"".join(out)


def _walk_state(qf, kp, vp, tables, seq, limit, start, softcap):
    """The decode kernel's state per row, in float64: the max score, the sum of exp(score - max),
    and that sum's weights times V (a row with no positions: -1e30, 0, 0)."""
    t, kvh, rep, d = qf.shape
    bs = kp.shape[1]
    mx, den = np.full((t, kvh, rep), -1e30), np.zeros((t, kvh, rep))
    acc = np.zeros((t, kvh, rep, d))
    for i in range(t):
        pos = np.arange(int(start[i]), int(limit[i]))
        if not len(pos):
            continue
        blocks = tables[int(seq[i]), pos // bs]
        k, v = kp[blocks, pos % bs].astype(np.float64), vp[blocks, pos % bs].astype(np.float64)
        scores = np.einsum("hrd,nhd->hrn", qf[i].astype(np.float64), k)
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        mx[i] = scores.max(-1)
        w = np.exp(scores - mx[i][..., None])
        den[i], acc[i] = w.sum(-1), np.einsum("hrn,nhd->hrd", w, v)
    return mx.astype(np.float32), den.astype(np.float32), acc.astype(np.float32)


def _run_check(binary, cases, tmp_path, runner=()):
    import subprocess

    path = tmp_path / "cases.bin"
    path.write_bytes(cases)
    r = subprocess.run([*runner, str(binary), str(path)], capture_output=True, text=True, timeout=300)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[-1] == "0 failed", r.stdout[-4000:] + r.stderr[-2000:]
    return lines


def test_standalone_check_passes_against_the_loaded_kernels(tmp_path):
    """cpp/check_kernels.cc, linked against this machine's kernel library (the build the engine
    loads), calls every kernel's FFI entry point on the cases and finds them within their
    references; a case whose reference is off fails, so the check can fail."""
    import shutil
    import subprocess

    cxx = shutil.which("g++")
    if cxx is None or not cpp_kernels.available():
        pytest.skip("needs g++ and the C++ kernels")
    lib, exe = cpp_kernels._build(), tmp_path / "check_kernels"
    cmd = [cxx, "-O1", "-std=c++17", "-I", jax.ffi.include_dir(), str(CHECK_SOURCE), str(lib),
           f"-Wl,-rpath,{lib.parent}", "-lpthread", "-o", str(exe)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    cases = _check_cases()
    lines = _run_check(exe, cases, tmp_path)
    assert sum(ln.startswith("PASS ") for ln in lines) == int(np.frombuffer(cases[4:8], np.uint32)[0]) > 40
    bad = bytearray(cases)
    bad[-16:] = np.float64([1e-12, 1e-12]).tobytes()  # the last case's last bounds (atol, rtol): tiny
    (tmp_path / "bad.bin").write_bytes(bytes(bad))
    r = subprocess.run([str(exe), str(tmp_path / "bad.bin")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "FAIL paged_decode" in r.stdout and r.stdout.endswith("1 failed\n"), r.stdout[-2000:]


AARCH64_CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
AARCH64_SYSROOT = "/usr/aarch64-linux-gnu"


def _cached_check(cxx: str, flags: list[str], tag: str, tmp_path) -> Path:
    """cpp/check_kernels.cc and the kernels' sources compiled with `cxx` and `flags` (each source in
    its own process) and linked, cached beside the kernel libraries as check-<tag>-<key>, keyed by
    the sources and flags."""
    import hashlib
    import shutil
    import subprocess

    sources = (CHECK_SOURCE, *cpp_kernels.SOURCES)
    key = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in sources + cpp_kernels.HEADERS),
                                     " ".join(flags).encode()])).hexdigest()[:16]
    exe = cpp_kernels.cache_dir() / f"check-{tag}-{key}"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        objs = [tmp_path / f"{src.stem}.o" for src in sources]
        procs = [subprocess.Popen([cxx, *flags, "-I", jax.ffi.include_dir(), "-c", str(src), "-o", str(o)],
                                  stderr=subprocess.PIPE, text=True) for src, o in zip(sources, objs)]
        errors = [p.communicate()[1] for p in procs if p.wait() != 0]
        assert not errors, errors[0][-3000:]
        res = subprocess.run([cxx, *map(str, objs), "-lpthread", "-o", str(tmp_path / "check")],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-2000:]
        shutil.move(tmp_path / "check", exe)
    return exe


def test_kernels_cross_built_for_aarch64_pass_under_qemu(tmp_path):
    """The C++ kernels compiled for aarch64 (NEON for the GGUF block products, the compiler's
    vectors elsewhere) with Debian's cross compiler, and cpp/check_kernels.cc run under qemu-user:
    every kernel within its reference. The binary is cached beside the kernel libraries, keyed by
    the sources and flags."""
    import shutil

    if not (shutil.which(AARCH64_CXX) and shutil.which(QEMU) and Path(AARCH64_SYSROOT).is_dir()):
        pytest.skip(f"needs {AARCH64_CXX} and {QEMU} with {AARCH64_SYSROOT} "
                    "(apt-get install g++-aarch64-linux-gnu qemu-user)")
    flags = [f for f in cpp_kernels.FLAGS if f != "-fPIC"] + ["-march=armv8-a"]
    exe = _cached_check(AARCH64_CXX, flags, "aarch64", tmp_path)
    lines = _run_check(exe, _check_cases(), tmp_path, runner=(QEMU, "-L", AARCH64_SYSROOT))
    assert lines[0] == "vector paths: matmul 0, blocks 1, tiles 0", lines[0]  # NEON block products


def test_kernels_built_for_baseline_x86_64_take_the_portable_paths(tmp_path):
    """The C++ kernels compiled for plain x86-64 (SSE2: no vector path of ours, the scalar loops
    every CPU without one runs, the GGUF tiles' for every format included) and cpp/check_kernels.cc
    run here: every kernel within its reference. Cached as the aarch64 binary is."""
    import shutil

    cxx = shutil.which("g++")
    if cxx is None or not cpp_kernels.available():
        pytest.skip("needs g++ and the C++ kernels")
    flags = [f for f in cpp_kernels.FLAGS if f != "-fPIC"] + ["-march=x86-64"]
    lines = _run_check(_cached_check(cxx, flags, "x86-64", tmp_path), _check_cases(), tmp_path)
    assert lines[0] == "vector paths: matmul 0, blocks 0, tiles 0", lines[0]
    assert sum(ln.startswith("PASS tiles q6_k") for ln in lines) == 4


# Stand-in compilers: each says a version; one writes an empty file wherever -o points, the other fails.
FAKE_CXX = """#!/bin/sh
[ "$1" = "--version" ] && { echo "fake-c++ 1.0"; exit 0; }
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && : > "$2"; shift; done
"""
BROKEN_CXX = """#!/bin/sh
[ "$1" = "--version" ] && { echo "broken-c++ 1.0"; exit 0; }
echo "fatal error: no room" >&2; exit 1
"""


def test_a_first_build_is_progress_and_a_failed_one_one_warning(monkeypatch, tmp_path, caplog, capsys):
    """A first build logs INFO and shows a bar on stderr (no WARNING: nothing is wrong); a build that
    fails is one WARNING line saying the engine falls back to XLA."""
    import logging

    for name, script in (("fake-cxx", FAKE_CXX), ("broken-cxx", BROKEN_CXX)):
        (tmp_path / name).write_text(script)
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("CXX", str(tmp_path / "fake-cxx"))
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.DEBUG, logger=cpp_kernels.__name__)
    lib = cpp_kernels._build(cpp_kernels.DEFAULT_CPU_TARGET)
    assert lib.exists() and lib.parent == tmp_path / "cache"
    levels = {r.levelno for r in caplog.records}
    assert levels == {logging.INFO}, [(r.levelname, r.getMessage()) for r in caplog.records]
    assert "building the C++ CPU kernels" in caplog.records[0].getMessage()
    assert f"{cpp_kernels.BUILD_BAR}: 100%" in capsys.readouterr().err

    caplog.clear()
    monkeypatch.setenv("CXX", str(tmp_path / "broken-cxx"))
    with pytest.raises(cpp_kernels.KernelUnavailable) as failed:
        cpp_kernels._build(cpp_kernels.DEFAULT_CPU_TARGET)
    assert "fatal error: no room" in str(failed.value) and "\n" in str(failed.value)
    # what the engine says of that build (the process's own library stays loaded: no reload here)
    monkeypatch.setattr(cpp_kernels, "_library_for", lambda target: str(failed.value))
    cpp_kernels._available.cache_clear()
    try:
        assert not cpp_kernels._available(cpp_kernels.DEFAULT_CPU_TARGET)
    finally:
        cpp_kernels._available.cache_clear()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0] and "falls back to XLA" in warnings[0], warnings
