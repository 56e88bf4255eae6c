"""Our C++ kernels for XLA:CPU, built on first use and called through XLA's FFI.

`kernel_backend="cpp"` (the default on CPU, through `auto`) runs decode attention in
cpp/paged_decode.cc, which reads K/V from the paged pool in place, and products of a few rows
(decode steps: W8A8, weight-only int8 and f32) in cpp/matmul.cc, and f32 rows against a GGUF
file's own quantization blocks in cpp/block_matmul.cc; these read a scanned step's weights in place; everything else stays the XLA lowering of runtime.worker.kernels. The sources are compiled once per machine into one library with the
system's C++ compiler (`$CXX`, else g++) against the FFI headers that ship with jaxlib, and cached
under ~/.cache/jaxserve/kernels (`JAXSERVE_KERNEL_CACHE`), keyed by the sources, the flags, the
compiler, jaxlib and the CPU. Without a compiler, `auto` falls back to the plain XLA lowering and
says why.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("cpp") / name for name in ("paged_decode.cc", "matmul.cc",
                                                                          "block_matmul.cc", "tile_matmul.cc"))
HEADERS = tuple(Path(__file__).with_name("cpp") / name for name in ("parallel_for.h", "tile_matmul.h"))
PAGED_DECODE_TARGET, INT8_MATMUL_TARGET = "jaxserve_paged_decode", "jaxserve_int8_matmul"
INT8_WEIGHT_MATMUL_TARGET, F32_MATMUL_TARGET = "jaxserve_int8_weight_matmul", "jaxserve_f32_matmul"
BLOCK_MATMUL_TARGET = "jaxserve_block_matmul"
# tile_matmul's activations -> block_matmul's layout attribute (cpp/block_matmul.cc)
TILE_ACTIVATIONS = {"q8": 1, "f32": 2}
# FFI target name -> the library's handler symbol.
TARGETS = {PAGED_DECODE_TARGET: "JaxservePagedDecode", INT8_MATMUL_TARGET: "JaxserveInt8Matmul",
           INT8_WEIGHT_MATMUL_TARGET: "JaxserveInt8WeightMatmul", F32_MATMUL_TARGET: "JaxserveF32Matmul",
           BLOCK_MATMUL_TARGET: "JaxserveBlockMatmul"}
# -ffast-math lets the compiler call glibc's vector expf; the kernel has no inf or NaN of its own
# (its running max starts at -1e30, as the XLA lowering's does). It is a compile flag only: linked
# with it, gcc adds crtfastmath.o, which on load turns on flush-to-zero for the whole process
# (numpy's and XLA's subnormals too), so the object is linked in a second step without it.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC")
LINK_FLAGS = ("-shared",)
# What the kernel's fixed-size scratch holds (cpp/paged_decode.cc); wider shapes take the XLA walk.
MAX_HEADS, MAX_BLOCK, MAX_DIM = 128, 64, 256


class KernelUnavailable(RuntimeError):
    """The C++ kernels cannot be built or loaded here."""


def cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_KERNEL_CACHE", Path.home() / ".cache" / "jaxserve" / "kernels"))


def _cpu_id() -> bytes:
    """The CPU's model and feature flags: -march=native code is only good on the CPU it was built for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform
        return platform.processor().encode()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))})).encode()


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise KernelUnavailable("no C++ compiler (set CXX, or install g++)")
    return cxx


def _build() -> Path:
    """The shared library for this machine, compiled if the cache has none."""
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise KernelUnavailable(f"{cxx} --version failed: {e}") from e
    include = jax.ffi.include_dir()
    parts = [*(src.read_bytes() for src in SOURCES + HEADERS), " ".join(FLAGS + LINK_FLAGS).encode(),
             version.encode(), include.encode(), jax.__version__.encode(), _cpu_id()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    lib = cache_dir() / f"kernels-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Processes starting at once (test workers, a server beside a benchmark) build once: the others
    # wait on the lock, then find the library (each built its own copy before: twice the CPU on a
    # 2-core machine, for one result).
    with open(lib.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        return _compile_into(lib, cxx, include)


def _compile_into(lib: Path, cxx: str, include: str) -> Path:
    log.warning("compiling the C++ CPU kernels into %s (once per machine; about a minute on 2 cores)", lib)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        objs = [Path(tmp) / (src.stem + ".o") for src in SOURCES]
        out = Path(tmp) / lib.name
        cmds = [[cxx, *FLAGS, "-I", include, "-c", str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objs)]
        for cmd in cmds + [[cxx, *LINK_FLAGS, *map(str, objs), "-o", str(out)]]:
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise KernelUnavailable(f"building the C++ kernels failed:\n{' '.join(cmd)}\n{res.stderr[-2000:]}")
        os.replace(out, lib)  # atomic: a reader never sees a partial file
    log.warning("C++ CPU kernels built in %.0f s", time.perf_counter() - t0)
    return lib


@functools.cache
def _library() -> ctypes.CDLL | str:
    """Builds, loads and registers the kernels once per process: the library, or why it failed."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (KernelUnavailable, OSError, AttributeError) as e:
        return str(e)
    return lib


def _load() -> str | None:
    """None once the kernels are registered; else the reason they cannot be."""
    lib = _library()
    return lib if isinstance(lib, str) else None


def ensure() -> None:
    """Raises KernelUnavailable (with the compiler's words) unless the kernels are ready to call."""
    error = _load()
    if error is not None:
        raise KernelUnavailable(error)


@functools.cache
def available() -> bool:
    """Whether the kernels can run here: on the CPU platform, with a working build (said once if not)."""
    if jax.default_backend() != "cpu":
        return False
    error = _load()
    if error is not None:
        log.warning("C++ CPU kernels unavailable, decode attention stays in XLA: %s", error)
    return error is None


def fits(num_kv_heads: int, n_rep: int, block_size: int, head_dim: int) -> bool:
    return num_kv_heads * n_rep <= MAX_HEADS and block_size <= MAX_BLOCK and head_dim <= MAX_DIM


# The shortest piece of one row's context that the decode kernel gives a thread of its own, when a
# step has too few rows to keep the threads busy (batch 1 at long context); docs/benchmarks/,
# "Decode attention in our C++ kernel", "Long rows split over the threads".
PART_TOKENS = 256
# Consecutive rows of one sequence (a prompt's tokens in a prefill chunk) walked together, at most (the
# kernel holds up to 128 query heads at once: SmolLM2's 9 take groups of 14).
GROUP_ROWS = 16


def paged_decode(qf, k_pool, v_pool, tables, seq, limit, part_tokens=PART_TOKENS, group_rows=GROUP_ROWS,
                 start=None, softcap=None):
    """The online-softmax state (max, denominator, accumulator) of rows `qf` [T, kvh, rep, d] (f32,
    scaled) over the pool positions in [start, limit) (each [T]; start None: 0) of their sequences
    `seq` [T], their scores capped by `softcap` (ir.attention_ops; None: not); see
    cpp/paged_decode.cc. Blocks wholly before a row's start are never read. The pools are read where they lie. A step of few rows splits each row's
    positions into parts of at least `part_tokens` over the threads (0: one row per thread); up to
    `group_rows` consecutive rows of one sequence, each seeing one more position than the one
    before (a prompt's tokens), walk its blocks together (1: each row alone)."""
    ensure()  # registered before anything is compiled (or loaded from the compilation cache) to call it
    t, kvh, rep, d = qf.shape
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((t, kvh, rep), f32), jax.ShapeDtypeStruct((t, kvh, rep), f32),
           jax.ShapeDtypeStruct((t, kvh, rep, d), f32))
    start = jnp.zeros_like(limit) if start is None else start
    return jax.ffi.ffi_call(PAGED_DECODE_TARGET, out)(qf.astype(f32), k_pool, v_pool, tables.astype(jnp.int32),
                                                      seq.astype(jnp.int32), limit.astype(jnp.int32),
                                                      start.astype(jnp.int32), part_tokens=np.int64(part_tokens),
                                                      group_rows=np.int64(group_rows),
                                                      softcap=np.float32(softcap or 0.0))


@functools.cache
def matmul_vectorized() -> bool:
    """Whether int8_matmul, int8_weight_matmul, f32_matmul and block_matmul have their vector paths on this CPU
    (AVX-512BW); without them the engine keeps XLA's products (the scalar loops are there for
    correctness only)."""
    if not available():
        return False
    return bool(_library().JaxserveMatmulVectorized())


def _layer_operand(w, layer):
    """The kernels' layer operand: `layer` of a stacked w [L, K, N], or 0 for a plain w [K, N]."""
    if (w.ndim == 3) != (layer is not None):
        raise ValueError(f"a stacked weight [L, K, N] takes a layer index, a [K, N] one none (w {w.shape}, "
                         f"layer {layer})")
    return jnp.asarray(0 if layer is None else layer, jnp.int32)


def int8_matmul(x, w, layer=None):
    """x s8 [M, K] @ w s8 [K, N] -> s32 [M, N], exact; see cpp/matmul.cc. Built for a few rows
    (W8A8 decode steps): it streams the weights once per four rows. With `layer` (an int32 scalar,
    traced or not), w is a stack [L, K, N] and the product takes its layer `layer` where it lies."""
    ensure()
    m, n = x.shape[0], w.shape[-1]
    return jax.ffi.ffi_call(INT8_MATMUL_TARGET, jax.ShapeDtypeStruct((m, n), jnp.int32))(
        x, w, _layer_operand(w, layer))


def int8_weight_matmul(x, w, layer=None):
    """x f32 [M, K] @ w s8 [K, N] -> f32 [M, N], w widened in registers; see cpp/matmul.cc.
    Built for decode steps under weight-only int8: it streams the weights once per four rows.
    `layer` as in int8_matmul."""
    ensure()
    m, n = x.shape[0], w.shape[-1]
    return jax.ffi.ffi_call(INT8_WEIGHT_MATMUL_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))(
        x, w, _layer_operand(w, layer))


def f32_matmul(x, w, layer=None):
    """x f32 [M, K] @ w f32 [K, N] -> f32 [M, N] (sums in k order per column); see cpp/matmul.cc.
    Built for decode steps: it streams the weights once per four rows. `layer` as in int8_matmul:
    what it is for, since XLA's own product would take a scanned step's layer as a copy."""
    ensure()
    m, n = x.shape[0], w.shape[-1]
    return jax.ffi.ffi_call(F32_MATMUL_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))(
        x, w, _layer_operand(w, layer))


def block_matmul(x, w, fmt: str, layer=None):
    """x f32 [M, K] @ w -> f32 [M, N], where w u8 [N, K / 32 * block bytes] holds the weights in
    GGUF quantization blocks of format `fmt` (ir.blocks.BLOCK_FORMATS), widened in registers; see
    cpp/block_matmul.cc. Built for decode steps: it reads each block once for all M rows. With
    `layer`, w is a stack [L, N, ...] and the product takes its layer `layer` where it lies."""
    from ir.blocks import BLOCK_FORMATS

    ensure()
    m, n = x.shape[0], w.shape[-2]
    return jax.ffi.ffi_call(BLOCK_MATMUL_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))(
        x, w, _layer_operand(w, layer), format=np.int64(BLOCK_FORMATS[fmt].type_id), layout=np.int64(0))


@functools.cache
def tiles_amx_bf16() -> bool:
    """Whether tile_matmul takes f32 activations' wide products on AMX-BF16 here (the CPU has it,
    and Linux grants the tile state): then those products run several times f32's rate."""
    if not available():
        return False
    return bool(_library().JaxserveTilesAmxBf16())


@functools.cache
def tiles_vectorized() -> bool:
    """Whether tile_matmul has its vector path on this CPU (AVX-512 VNNI)."""
    if not available():
        return False
    return bool(_library().JaxserveTilesVectorized())


def tile_matmul(x, w, fmt: str, layer=None, activations: str = "q8"):
    """x f32 [M, K] @ w -> f32 [M, N], where w u8 [N / 16, K / 32 * record bytes] holds GGUF blocks
    of format `fmt` repacked into tiles of 16 columns (ir.blocks.pack_tiles); see cpp/tile_matmul.cc.
    `activations` "q8": multiplied in int8, x quantized per block of 32 as llama.cpp does; "f32":
    x as it is (the f32 product up to the order of its sums; AMX-BF16 on three exact bf16 parts of
    x from 16 rows where the CPU has it, f32 multiply-adds otherwise). `layer` as in block_matmul."""
    from ir.blocks import BLOCK_FORMATS, TILE_COLUMNS

    if activations not in TILE_ACTIVATIONS:
        raise ValueError(f"tile_matmul activations must be one of {TILE_ACTIVATIONS}, got {activations!r}")
    ensure()
    m, n = x.shape[0], w.shape[-2] * TILE_COLUMNS
    return jax.ffi.ffi_call(BLOCK_MATMUL_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))(
        x, w, _layer_operand(w, layer), format=np.int64(BLOCK_FORMATS[fmt].type_id),
        layout=np.int64(TILE_ACTIVATIONS[activations]))
