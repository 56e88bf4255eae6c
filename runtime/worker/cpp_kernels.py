"""Our C++ kernels for XLA:CPU, built on first use and called through XLA's FFI.

`kernel_backend="cpp"` (the default on CPU, through `auto`) runs decode attention in
cpp/paged_decode.cc, which reads K/V from the paged pool in place, and products of a few rows
(decode steps: W8A8, weight-only int8 and f32) in cpp/matmul.cc, and f32 rows against a GGUF
file's own quantization blocks in cpp/block_matmul.cc; these read a scanned step's weights in place; everything else stays the XLA lowering of runtime.worker.kernels. The sources are compiled once per machine into one library with the
system's C++ compiler (`$CXX`, else g++) against the FFI headers that ship with jaxlib, for the
CPU class JAXSERVE_CPU_TARGET names (CPU_TARGETS: `native`, the default; `x86-64-v3`, AVX2;
`x86-64-v4`, AVX-512 without VNNI or AMX; `x86-64-v4-amx`; `none`, no kernels), and cached under
$XDG_CACHE_HOME/jaxserve/kernels (default ~/.cache/jaxserve/kernels; `JAXSERVE_KERNEL_CACHE` names
another), keyed by the sources, the target and its flags, the compiler, jaxlib and, for `native`,
the CPU. Each vector path is in the library only where the target has its instructions, and the
library says which it has (`paths()`), so every choice the engine makes from them follows the built
target; a target this CPU cannot run is not built.
Without a build (no compiler, a target this CPU lacks, `none`), `auto` falls back to the plain XLA
lowering and says why, once.
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
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from config.flags import UserError
from models.user_cache import user_cache_dir

log = logging.getLogger(__name__)

KERNEL_CACHE_ENV = "JAXSERVE_KERNEL_CACHE"

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
FLAGS = ("-O3", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC")
# JAXSERVE_CPU_TARGET -> the compiler's target flags: the CPU class the kernels are built for, and so
# which of their vector paths exist (each source picks its path from the compiler's macros, so a
# path is live only where the build has it). `none`: no C++ kernels, XLA's lowerings only.
CPU_TARGETS = {
    "native": ("-march=native",),
    "x86-64-v3": ("-march=x86-64-v3",),  # AVX2, FMA, F16C
    "x86-64-v4": ("-march=x86-64-v4",),  # AVX-512 F/BW/CD/DQ/VL, no VNNI, no AMX
    "x86-64-v4-amx": ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16"),
    "none": None,
}
DEFAULT_CPU_TARGET = "native"
# What a named target's code executes, as /proc/cpuinfo names it: a host without all of it cannot
# load that build (its first AVX-512 instruction would be SIGILL), and stays on XLA.
_V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
TARGET_NEEDS = {"x86-64-v3": _V3, "x86-64-v4": _V4,
                "x86-64-v4-amx": _V4 + ("avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")}
LINK_FLAGS = ("-shared",)
# What the kernel's fixed-size scratch holds (cpp/paged_decode.cc); wider shapes take the XLA walk.
MAX_HEADS, MAX_BLOCK, MAX_DIM = 128, 64, 256


class KernelUnavailable(RuntimeError):
    """The C++ kernels cannot be built or loaded here."""


class BadCpuTarget(UserError, ValueError):
    """JAXSERVE_CPU_TARGET names no target we build, or JAXSERVE_CPU_POLL_US is no number of
    microseconds we take (one `error:` line on the command line)."""


# JAXSERVE_CPU_POLL_US: how long the kernels' helper threads poll for the next call after each one
# before they sleep (cpp/parallel_for.h); checked here and handed to each library as it loads.
POLL_ENV, DEFAULT_POLL_US, MAX_POLL_US = "JAXSERVE_CPU_POLL_US", 300, 1_000_000


def cpu_poll_us() -> int:
    """JAXSERVE_CPU_POLL_US, checked: microseconds, 0 (sleep at once) to 1,000,000; default 300."""
    raw = os.environ.get(POLL_ENV) or str(DEFAULT_POLL_US)
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_POLL_US:
        raise BadCpuTarget(f"{POLL_ENV} must be a whole number of microseconds from 0 to {MAX_POLL_US:,}; "
                           f"got {raw!r}")
    return int(raw)


def cache_dir() -> Path:
    """Where the built libraries are kept (models.user_cache: JAXSERVE_KERNEL_CACHE, else
    $XDG_CACHE_HOME/jaxserve/kernels, else ~/.cache/jaxserve/kernels)."""
    return user_cache_dir("kernels", KERNEL_CACHE_ENV)


def cpu_target() -> str:
    """JAXSERVE_CPU_TARGET, checked: the CPU class the kernels are built for (CPU_TARGETS)."""
    target = os.environ.get("JAXSERVE_CPU_TARGET") or DEFAULT_CPU_TARGET
    if target not in CPU_TARGETS:
        raise BadCpuTarget(f"JAXSERVE_CPU_TARGET must be one of {', '.join(CPU_TARGETS)}; got {target!r}")
    return target


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return {f for ln in lines if ln.startswith("flags") for f in ln.split(":", 1)[1].split()}


def _cpu_id() -> bytes:
    """The CPU's model and feature flags: -march=native code is only good on the CPU it was built for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform
        return platform.processor().encode()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))})).encode()


def _target_flags(target: str) -> tuple[str, ...]:
    """The compiler flags for `target`, or KernelUnavailable where this machine cannot run its code."""
    import platform

    flags = CPU_TARGETS[target]
    if flags is None:
        raise KernelUnavailable(f"JAXSERVE_CPU_TARGET={target}: no C++ kernels")
    if target in TARGET_NEEDS:
        if platform.machine() not in ("x86_64", "AMD64"):
            raise KernelUnavailable(f"JAXSERVE_CPU_TARGET={target} is an x86-64 target; this CPU is "
                                    f"{platform.machine()}")
        missing = [f for f in TARGET_NEEDS[target] if f not in _cpu_flags()]
        if missing:
            raise KernelUnavailable(f"JAXSERVE_CPU_TARGET={target} needs {', '.join(missing)}, which this CPU "
                                    "lacks (its code would stop on an illegal instruction)")
    return (*FLAGS, *flags)


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise KernelUnavailable("no C++ compiler (set CXX, or install g++)")
    return cxx


def _build(target: str | None = None) -> Path:
    """The shared library for `target` (None: JAXSERVE_CPU_TARGET) on this machine, compiled if the
    cache has none."""
    lib, cxx, include, flags = library_path(target)
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
        return _compile_into(lib, cxx, include, flags)


def library_path(target: str | None = None) -> tuple[Path, str, str, tuple[str, ...]]:
    """(where the cache keeps `target`'s library, the compiler, jaxlib's FFI include dir, the flags),
    built or not; KernelUnavailable where it cannot be built."""
    target = target or cpu_target()
    flags = _target_flags(target)
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise KernelUnavailable(f"{cxx} --version failed: {e}") from e
    include = jax.ffi.include_dir()
    # A named target's code runs on any CPU that has its features; native code only on this one.
    cpu = _cpu_id() if target == "native" else b""
    parts = [*(src.read_bytes() for src in SOURCES + HEADERS), " ".join(flags + LINK_FLAGS).encode(),
             target.encode(), version.encode(), include.encode(), jax.__version__.encode(), cpu]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return cache_dir() / f"kernels-{key}.so", cxx, include, flags


# A first build is progress, not a problem: an INFO line and a bar on stderr (where the bucket bars
# are). A failed one is the WARNING that _available logs: the engine runs XLA's lowerings instead.
BUILD_BAR = "build C++ kernels (one time per machine, 20-50 s on 2 cores)"


def _compile_into(lib: Path, cxx: str, include: str, flags: tuple[str, ...] = ()) -> Path:
    from tqdm import tqdm

    log.info("building the C++ CPU kernels (%s) into %s: one time per machine, 20-50 s on 2 cores",
             " ".join(flags[len(FLAGS):]) or "no vector paths", lib)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        objs = [Path(tmp) / (src.stem + ".o") for src in SOURCES]
        out = Path(tmp) / lib.name
        # The sources compile side by side (one compiler per core, at most), then one link.
        cmds = [[cxx, *flags, "-I", include, "-c", str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objs)]
        width = max(1, min(len(cmds), os.cpu_count() or 1))
        with tqdm(total=len(cmds) + 1, desc=BUILD_BAR, unit="step", file=sys.stderr) as bar:
            for i in range(0, len(cmds), width):
                _run_all(cmds[i:i + width], bar)
            _run_all([[cxx, *LINK_FLAGS, *map(str, objs), "-o", str(out)]], bar)
        os.replace(out, lib)  # atomic: a reader never sees a partial file
    log.info("C++ CPU kernels built in %.0f s", time.perf_counter() - t0)
    return lib


def _run_all(cmds: list[list[str]], bar=None) -> None:
    procs = [(cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
             for cmd in cmds]
    failed = None
    for cmd, p in procs:
        _, err = p.communicate()
        if bar is not None:
            bar.update()
        if p.returncode != 0 and failed is None:
            failed = f"building the C++ kernels failed:\n{' '.join(cmd)}\n{err[-2000:]}"
    if failed:
        raise KernelUnavailable(failed)


def ffi_name(name: str, target: str | None = None) -> str:
    """The FFI target under which `target`'s build (None: JAXSERVE_CPU_TARGET) registers the kernel
    `name`: builds for several targets can be loaded side by side in one process (the tests' matrix),
    and XLA's FFI registry takes each name once."""
    target = target or cpu_target()
    return name if target == DEFAULT_CPU_TARGET else f"{name}_{target.replace('-', '_')}"


@functools.cache
def _library_for(target: str) -> ctypes.CDLL | str:
    """Builds, loads and registers `target`'s kernels once per process: the library, or why it failed."""
    poll_us = cpu_poll_us()  # a bad value is the user's error, not a reason to fall back to XLA
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build(target)))
        lib.JaxserveSetHelperPollUs(ctypes.c_int64(poll_us))  # before any kernel starts the helpers
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(ffi_name(name, target), jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except (KernelUnavailable, OSError, AttributeError) as e:
        return str(e)
    return lib


def _library() -> ctypes.CDLL | str:
    return _library_for(cpu_target())


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
def _available(target: str) -> bool:
    if jax.default_backend() != "cpu":
        return False
    lib = _library_for(target)
    error = lib if isinstance(lib, str) else None
    if error is not None:  # one line; a compiler's output follows at DEBUG (selfcheck's cpu part prints it)
        first, _, rest = error.partition("\n")
        log.warning("C++ CPU kernels unavailable, the engine falls back to XLA's lowerings: %s%s", first,
                    " (the compiler's output: `jaxserve selfcheck --only cpu`)" if rest else "")
        if rest:
            log.debug("%s", rest)
    return error is None


def available() -> bool:
    """Whether the kernels can run here: on the CPU platform, with a working build for
    JAXSERVE_CPU_TARGET (said once if not)."""
    return _available(cpu_target())


@functools.cache
def _has(target: str, symbol: str) -> bool:
    return _available(target) and bool(getattr(_library_for(target), symbol)())


def matmul_vectorized() -> bool:
    """Whether int8_matmul, int8_weight_matmul and f32_matmul have their vector paths in this build
    (AVX-512BW); without them the engine keeps XLA's products (the scalar loops are there for
    correctness only)."""
    return _has(cpu_target(), "JaxserveMatmulVectorized")


def blocks_vectorized() -> bool:
    """Whether block_matmul (GGUF blocks in the file's rows) has a vector path in this build
    (AVX-512BW, AVX2 with FMA and F16C, or aarch64 NEON); without it the engine multiplies by the f32
    weights."""
    return _has(cpu_target(), "JaxserveBlocksVectorized")


def blocks_max_rows() -> int:
    """The most rows of a step whose product reads the GGUF blocks in this build (64 with AVX-512BW,
    16 with AVX2 or NEON; 0 without the vector path): wider steps multiply by the f32 weights."""
    return int(_available(cpu_target()) and _library_for(cpu_target()).JaxserveBlocksMaxRows())


def tiles_amx_bf16() -> bool:
    """Whether tile_matmul takes f32 activations' wide products on AMX-BF16 here (the build has it,
    and Linux grants the tile state): then those products run several times f32's rate."""
    return _has(cpu_target(), "JaxserveTilesAmxBf16")


def tiles_vectorized(activations: str = "q8") -> bool:
    """Whether tile_matmul has its vector path for `activations` in this build: "q8" needs AVX-512
    VNNI or AVX2 (vpmaddubsw, as llama.cpp); "f32" AVX-512BW or AVX2 with FMA (f32 multiply-adds,
    integer products of the activations' 16-bit parts for few rows, and AMX-BF16 from 16 rows where
    tiles_amx_bf16())."""
    if activations == "f32":
        return _has(cpu_target(), "JaxserveTilesF32Vectorized")
    return _has(cpu_target(), "JaxserveTilesVectorized")


EVERY_STEP = 1 << 30  # tiles_max_rows of a path that takes every step's product


def tiles_max_rows(activations: str = "q8") -> int:
    """The most rows of a step whose product the tiles' vector path for `activations` should take in
    this build: EVERY_STEP where it has one (AVX-512BW; AVX2 with FMA, which from 8 rows widens a
    slice of a tile to f32 once for all the rows, so that no f32 copy of the weights is kept for
    wide steps), 0 without."""
    return EVERY_STEP if tiles_vectorized(activations) else 0


def helper_poll_us() -> int | None:
    """How long the kernels' helper threads poll after each call in this process, as the loaded
    library holds it (None where the kernels are not live)."""
    if not available():
        return None
    fn = _library().JaxserveHelperPollUs
    fn.restype = ctypes.c_int64
    return int(fn())


def paths() -> dict[str, bool]:
    """Which kernel paths are live for JAXSERVE_CPU_TARGET on this machine (`jaxserve env`,
    selfcheck): each is in the build and runs on this CPU."""
    return {"paged_decode": available(), "matmul_avx512bw": matmul_vectorized(),
            "gguf_blocks": blocks_vectorized(), "gguf_tiles_q8": tiles_vectorized(),
            "gguf_tiles_f32": tiles_vectorized("f32"),
            "gguf_tiles_amx_bf16": tiles_amx_bf16()}


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
    return jax.ffi.ffi_call(ffi_name(PAGED_DECODE_TARGET), out)(qf.astype(f32), k_pool, v_pool, tables.astype(jnp.int32),
                                                      seq.astype(jnp.int32), limit.astype(jnp.int32),
                                                      start.astype(jnp.int32), part_tokens=np.int64(part_tokens),
                                                      group_rows=np.int64(group_rows),
                                                      softcap=np.float32(softcap or 0.0))


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
    return jax.ffi.ffi_call(ffi_name(INT8_MATMUL_TARGET), jax.ShapeDtypeStruct((m, n), jnp.int32))(
        x, w, _layer_operand(w, layer))


def int8_weight_matmul(x, w, layer=None):
    """x f32 [M, K] @ w s8 [K, N] -> f32 [M, N], w widened in registers; see cpp/matmul.cc.
    Built for decode steps under weight-only int8: it streams the weights once per four rows.
    `layer` as in int8_matmul."""
    ensure()
    m, n = x.shape[0], w.shape[-1]
    return jax.ffi.ffi_call(ffi_name(INT8_WEIGHT_MATMUL_TARGET), jax.ShapeDtypeStruct((m, n), jnp.float32))(
        x, w, _layer_operand(w, layer))


def f32_matmul(x, w, layer=None):
    """x f32 [M, K] @ w f32 [K, N] -> f32 [M, N] (sums in k order per column); see cpp/matmul.cc.
    Built for decode steps: it streams the weights once per four rows. `layer` as in int8_matmul:
    what it is for, since XLA's own product would take a scanned step's layer as a copy."""
    ensure()
    m, n = x.shape[0], w.shape[-1]
    return jax.ffi.ffi_call(ffi_name(F32_MATMUL_TARGET), jax.ShapeDtypeStruct((m, n), jnp.float32))(
        x, w, _layer_operand(w, layer))


def block_matmul(x, w, fmt: str, layer=None):
    """x f32 [M, K] @ w -> f32 [M, N], where w u8 [N, K / 32 * block bytes] holds the weights in
    GGUF quantization blocks of format `fmt` (ir.blocks.BLOCK_FORMATS), widened in registers; see
    cpp/block_matmul.cc. Built for decode steps: it reads each block once for all M rows. With
    `layer`, w is a stack [L, N, ...] and the product takes its layer `layer` where it lies."""
    from ir.blocks import BLOCK_FORMATS

    ensure()
    m, n = x.shape[0], w.shape[-2]
    return jax.ffi.ffi_call(ffi_name(BLOCK_MATMUL_TARGET), jax.ShapeDtypeStruct((m, n), jnp.float32))(
        x, w, _layer_operand(w, layer), format=np.int64(BLOCK_FORMATS[fmt].type_id), layout=np.int64(0))


def tile_matmul(x, w, fmt: str, layer=None, activations: str = "q8"):
    """x f32 [M, K] @ w -> f32 [M, N], where w u8 [N / 16, K / 32 * record bytes] holds GGUF blocks
    of format `fmt` repacked into tiles of 16 columns (ir.blocks.pack_tiles); see cpp/tile_matmul.cc.
    `activations` "q8": multiplied in int8, x quantized per block of 32 as llama.cpp does; "f32":
    x as it is (the f32 product up to the order of its sums; AMX-BF16 on three exact bf16 parts of
    x from 16 rows where the CPU has it, f32 multiply-adds otherwise). `layer` as in block_matmul."""
    from ir.blocks import KEPT_FORMATS, TILE_COLUMNS

    if activations not in TILE_ACTIVATIONS:
        raise ValueError(f"tile_matmul activations must be one of {TILE_ACTIVATIONS}, got {activations!r}")
    ensure()
    m, n = x.shape[0], w.shape[-2] * TILE_COLUMNS
    return jax.ffi.ffi_call(ffi_name(BLOCK_MATMUL_TARGET), jax.ShapeDtypeStruct((m, n), jnp.float32))(
        x, w, _layer_operand(w, layer), format=np.int64(KEPT_FORMATS[fmt].type_id),
        layout=np.int64(TILE_ACTIVATIONS[activations]))
