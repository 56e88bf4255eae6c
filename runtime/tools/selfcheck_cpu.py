"""The `cpu` part of `jaxserve selfcheck`: what a CPU engine runs, against references.

On a CPU the engine's decode attention and its products of few rows run in our C++ kernels
(runtime/worker/cpp/), and a GGUF model's weights are read from the file's own quantization blocks,
or from those blocks repacked into tiles. This part builds the kernels (or finds them in the
kernel cache), says which vector paths this CPU takes (AVX-512BW, AVX-512 VNNI, AMX-BF16), and
checks each kernel against its reference on SmolLM2's shapes:

  paged attention  decode rows, and one long row split over the threads, against the jnp reference
  f32 / int8 rows  f32_matmul, int8_weight_matmul (weights widened) and int8_matmul (W8A8, exact)
  GGUF blocks      block_matmul on Q4_0, Q4_1 and Q8_0 rows against gguf's own dequantization
  GGUF tiles       tile_matmul with f32 activations (AMX-BF16 from 16 rows where the CPU has it) and
                   with q8 activations (int8, as llama.cpp), against the f64 product

Off the CPU backend it checks nothing and says n.a.: these kernels only run on XLA:CPU.
"""

from __future__ import annotations

import time

# Bounds, as the kernels' own tests hold them (tests/test_cpp_kernels.py, test_gguf_blocks.py,
# test_gguf_tiles.py): a product in f32 against the f64 product, relative to the largest output.
PRODUCT_RTOL = 1e-5
# f32 attention through the online softmax against the jnp reference (pallas_kernels.testing).
ATTENTION = dict(rtol=1e-5, atol=1e-5)
# SmolLM2's heads (9 q / 3 kv, head_dim 64) in 32-token blocks; its widths (576 in, 1536 out).
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 32
K, N = 576, 192


def _attention_rows():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ir.attention_ops import paged_attention_reference
    from pallas_kernels.testing import random_paged_cache
    from runtime.worker.kernels import paged_attention_xla

    def case(ctx, seed):
        rng = np.random.default_rng(seed)
        k_pool, v_pool, tables, _ = random_paged_cache(rng, ctx, block_size=BLOCK, num_kv_heads=KV_HEADS,
                                                       head_dim=HEAD_DIM, dtype=jnp.float32, poison=True)
        q = jnp.asarray(rng.standard_normal((len(ctx), HEADS, HEAD_DIM)), jnp.float32)
        cu = jnp.arange(len(ctx) + 1, dtype=jnp.int32)
        args = (q, jnp.asarray(k_pool), jnp.asarray(v_pool), tables, jnp.asarray(ctx, jnp.int32), cu)
        attrs = dict(scale=HEAD_DIM ** -0.5, num_kv_heads=KV_HEADS, block_size=BLOCK, head_dim=HEAD_DIM)
        got = jax.jit(lambda *a: paged_attention_xla(*a, **attrs, row_kernel=True))(*args)
        want = paged_attention_reference(*args, **attrs)
        return np.asarray(got), np.asarray(want)

    yield "paged attention: 8 decode rows, contexts 1-700", lambda: case([1, 31, 32, 33, 100, 257, 511, 700], 0)
    yield "paged attention: one row of 3,000 split over the threads", lambda: case([3000], 1)


def _product_rows(features: dict[str, bool]):
    import gguf
    import jax
    import jax.numpy as jnp
    import numpy as np
    from gguf.quants import dequantize, quantize

    from ir.blocks import BLOCK_FORMATS, pack_tiles, round_q8
    from runtime.worker import cpp_kernels as cpp

    rng = np.random.default_rng(3)

    def product(m, f):
        x = rng.standard_normal((m, K)).astype(np.float32)
        w = (rng.standard_normal((K, N)) * 0.1).astype(np.float32)
        return x, w, f(x, w)

    def f32(m):
        x, w, got = product(m, lambda x, w: jax.jit(cpp.f32_matmul)(x, w))
        return np.asarray(got), x.astype(np.float64) @ w.astype(np.float64)

    def int8_weights(m):
        w8 = rng.integers(-127, 128, (K, N)).astype(np.int8)
        x = rng.standard_normal((m, K)).astype(np.float32)
        return np.asarray(jax.jit(cpp.int8_weight_matmul)(x, w8)), x.astype(np.float64) @ w8.astype(np.float64)

    def w8a8(m):
        x8 = rng.integers(-127, 128, (m, K)).astype(np.int8)
        w8 = rng.integers(-127, 128, (K, N)).astype(np.int8)
        return np.asarray(jax.jit(cpp.int8_matmul)(x8, w8)), x8.astype(np.int64) @ w8.astype(np.int64)

    def quantized(fmt):
        qtype = gguf.GGMLQuantizationType(BLOCK_FORMATS[fmt].type_id)
        blocks = quantize((rng.standard_normal((N, K)) * 0.1).astype(np.float32), qtype)
        return blocks, dequantize(blocks, qtype).astype(np.float64)

    def blocks(fmt, m):
        b, values = quantized(fmt)
        x = rng.standard_normal((m, K)).astype(np.float32)
        got = jax.jit(lambda a, w: cpp.block_matmul(a, w, fmt))(x, b)
        return np.asarray(got), x.astype(np.float64) @ values.T

    def tiles(fmt, m, activations):
        b, values = quantized(fmt)
        x = rng.standard_normal((m, K)).astype(np.float32)
        got = jax.jit(lambda a, w: cpp.tile_matmul(a, w, fmt, activations=activations))(x, pack_tiles(b, fmt))
        xs = np.asarray(round_q8(jnp.asarray(x))) if activations == "q8" else x
        return np.asarray(got), xs.astype(np.float64) @ values.T

    vec = "AVX-512BW" if features["avx512bw"] else "scalar loop (no AVX-512BW: the engine keeps XLA's product)"
    yield f"f32 rows 1, 4, 8 ({vec})", lambda: _stack(f32(m) for m in (1, 4, 8))
    yield f"weight-only int8 rows 1, 16, 64 ({vec})", lambda: _stack(int8_weights(m) for m in (1, 16, 64))
    yield f"W8A8 rows 1, 4, exact int32 ({vec})", lambda: _stack(w8a8(m) for m in (1, 4))
    bvec = {"avx512bw": "AVX-512BW", "avx2": "AVX2+FMA+F16C"}.get(
        features.get("blocks"), "scalar loop (no AVX-512BW or AVX2: the engine keeps XLA's product)")
    for fmt in BLOCK_FORMATS:
        yield f"GGUF {fmt} blocks, rows 1, 8, 64 ({bvec})", lambda fmt=fmt: _stack(blocks(fmt, m) for m in (1, 8, 64))
    amx = ("AMX-BF16 from 16 rows" if features["amx_bf16"] else "AVX-512BW multiply-adds (no AMX-BF16)"
           if features["avx512bw"] else "scalar loop (no AVX-512BW: the engine keeps the file's rows)")
    vnni = ("int8 dot products: AVX-512 VNNI, or AVX2's vpmaddubsw" if features["vnni"]
            else "scalar loop (no AVX2 or VNNI)")
    for fmt in BLOCK_FORMATS:
        yield f"GGUF {fmt} tiles, f32 activations, rows 1, 16, 64 ({amx})", \
            lambda fmt=fmt: _stack(tiles(fmt, m, "f32") for m in (1, 16, 64))
        yield f"GGUF {fmt} tiles, q8 activations, rows 1, 64 ({vnni})", \
            lambda fmt=fmt: _stack(tiles(fmt, m, "q8") for m in (1, 64))


def cpu_features() -> dict:
    """The vector paths the C++ kernels' build has on this CPU, as cpu_checks names them."""
    from runtime.worker import cpp_kernels as cpp

    blocks = None if not cpp.blocks_vectorized() else "avx512bw" if cpp.matmul_vectorized() else "avx2"
    return {"avx512bw": cpp.matmul_vectorized(), "blocks": blocks, "vnni": cpp.tiles_vectorized(),
            "amx_bf16": cpp.tiles_amx_bf16()}


def _stack(pairs) -> tuple:
    """Several (got, want) checked as one: the largest relative miss among them decides."""
    return tuple(zip(*pairs))


def _miss(got, want, attention: bool) -> tuple[bool, float]:
    """(within bounds, largest miss relative to the largest expected value)."""
    import numpy as np

    gots, wants = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    worst, ok = 0.0, True
    for g, w in zip(gots, wants):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape or not np.isfinite(g).all():
            return False, float("inf")
        scale = max(float(np.abs(w).max()), 1e-30)
        worst = max(worst, float(np.abs(g - w).max()) / scale)
        ok &= bool(np.allclose(g, w, **ATTENTION)) if attention else \
            bool(np.all(np.abs(g - w) <= PRODUCT_RTOL * scale))
    return ok, worst


def cpu_checks(features: dict[str, bool]) -> list[tuple[str, object, bool]]:
    """(name, run -> (got, want), is attention) for every check, in order."""
    return [(n, f, True) for n, f in _attention_rows()] + [(n, f, False) for n, f in _product_rows(features)]


def part_cpu(args) -> tuple[bool, str, dict]:
    import jax

    from runtime.tools.selfcheck_parts import _print_rows, _short
    from runtime.worker import cpp_kernels as cpp

    if jax.default_backend() != "cpu":
        why = f"n.a.: the C++ kernels run on XLA:CPU only (backend here: {jax.default_backend()})"
        print(why)
        return True, why, {"applies": False}
    t0 = time.perf_counter()
    try:
        cpp.ensure()
    except cpp.KernelUnavailable as err:
        print(err)
        why = "n.a.: the C++ kernels do not build here (above); the engine runs XLA's lowerings instead"
        return True, why, {"applies": False}
    build_s = time.perf_counter() - t0
    features = cpu_features()
    print(f"C++ kernels ready in {build_s:.1f} s (built, or found in {cpp.cache_dir()}); "
          f"JAXSERVE_CPU_TARGET={cpp.cpu_target()}: "
          + ", ".join(f"{k} {v if isinstance(v, str) else 'yes' if v else 'no'}" for k, v in features.items()), flush=True)
    rows = [("check", "status", "max rel miss", "s")]
    results = []
    for name, run, attention in cpu_checks(features):
        t1 = time.perf_counter()
        try:
            ok, miss = _miss(*run(), attention=attention)
            problem = None if ok else "outside the bound"
        except Exception as err:  # noqa: BLE001 (report the row, check the rest)
            ok, miss, problem = False, float("nan"), _short(err)
        seconds = time.perf_counter() - t1
        results.append({"check": name, "ok": ok, "max_rel_miss": miss, "problem": problem, "seconds": seconds})
        rows.append((name, "PASS" if ok else f"FAIL {problem}", f"{miss:.1e}", f"{seconds:.1f}"))
        print(f"  {name}: {rows[-1][1]}", flush=True)
    _print_rows(rows)
    failed = [r for r in results if not r["ok"]]
    paths = "/".join(k for k, v in features.items() if v) or "scalar loops"
    summary = f"{len(results) - len(failed)}/{len(results)} C++ kernel checks within bounds ({paths})"
    if failed:
        summary += "; failed: " + ", ".join(r["check"] for r in failed)
    return not failed, summary, {"applies": True, "features": features, "build_s": build_s, "rows": results}
