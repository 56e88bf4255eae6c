"""Compiled executables saved whole, so that a warm start skips tracing and lowering as well as
compiling.

JAX's persistent compilation cache (runtime.engine.build) keys an executable by its lowered program, so a
warm start still traces each bucket's step in Python and lowers it to StableHLO just to find the
key: about 1-2 s per bucket of the unrolled 30-layer SmolLM2 step, as much as loading the
executable itself (docs/benchmarks/, "Start-up"). This store keys each executable by what its program
is made from, all known before any tracing:

- the plan's program (model config, engine options, final graph: `Plan.program_hash`);
- what is compiled (step, multi-step, block copy, prompt logprobs), its argument shapes and dtypes,
  and the kernel backend;
- the source of every module that shapes the traced program (ir/, passes/, pallas_kernels/,
  runtime/worker/, C++ kernels included);
- jax and jaxlib, the device, the CPU's features and JAXSERVE_CPU_TARGET, XLA_FLAGS and the jax options that change a trace;

and keeps `jax.experimental.serialize_executable`'s bytes in one file per key. A miss (a new key,
an unreadable file, which is removed) lowers and compiles as before, and saves the result only if
XLA compiled it: an executable that JAX's persistent cache served serializes without its code on
XLA:CPU. So the store counts this thread's backend compiles and cache hits around `.compile()`
alone (a trace may compile small eager ops of its own, which prove nothing), and stores only when
a compile happened and no cache hit did. It fills on starts that compile (the first start of a
cache, or after a change to the program); a start that JAX's cache serves whole leaves it as it
was. An entry loads onto the runner's one device, which is part of its key, never onto every
device the backend has (forced host devices). Like any store of compiled code, its directory must
be trusted: the files are pickles.

Entries of older code never load again, so the store is bounded: after each save, the least
recently used entries (a load or a save is a use) go until the directory holds at most
JAXSERVE_EXECUTABLE_STORE_MAX_GB (default 4; the default SmolLM2 engine's entries take 110 MB).

A store may be backed by a `shared` one (`jaxserve compile` backs a plan directory's store with
the per-user store that `jaxserve serve --model` fills, runtime.engine.build): a miss in its own directory
loads the entry from the shared one and keeps a copy (a hard link where the file system allows),
so that the plan directory still holds all it needs, and an executable it compiles goes to both.
The key names no directory, so the same model and flags find the same entries either way.

Code that changes a trace without changing those sources (a test's monkeypatch, a benchmark's
swapped module) must not use the store: `JAXSERVE_EXECUTABLE_STORE=0` turns it off, and
runtime.engine.build uses it only where it chooses the compilation cache itself.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import sys
import tempfile
import threading
from pathlib import Path

import jax

log = logging.getLogger(__name__)

ENV_SWITCH = "JAXSERVE_EXECUTABLE_STORE"
MAX_GB_ENV = "JAXSERVE_EXECUTABLE_STORE_MAX_GB"
DEFAULT_MAX_GB = 4.0  # the default f32 SmolLM2 engine's entries take about 110 MB
ROOT = Path(__file__).resolve().parents[2]
# Folders whose source shapes a traced step (runtime/core, the scheduler, never reaches a trace).
TRACED_SOURCES = ("ir", "passes", "pallas_kernels", "runtime/worker")
SOURCE_SUFFIXES = (".py", ".cc", ".h")
# jax options that change what a trace lowers to.
TRACE_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
                 "jax_default_prng_impl", "jax_threefry_partitionable", "jax_numpy_dtype_promotion")


_compile_lock = threading.Lock()
_num_compiles = 0
_listener_installed = False
# This thread's backend compiles and persistent-cache hits (JAX reports both on the compiling thread).
_this_thread = threading.local()


def _on_event_duration(event: str, duration: float, **kw) -> None:
    global _num_compiles
    if event == "/jax/core/compile/backend_compile_duration":
        with _compile_lock:
            _num_compiles += 1
        _this_thread.compiles = getattr(_this_thread, "compiles", 0) + 1


def _on_event(event: str, **kw) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _this_thread.cache_hits = getattr(_this_thread, "cache_hits", 0) + 1


def num_backend_compiles() -> int:
    """XLA backend compilations in this process so far (cache hits from disk not included)."""
    global _listener_installed
    if not _listener_installed:
        jax.monitoring.register_event_duration_secs_listener(_on_event_duration)
        jax.monitoring.register_event_listener(_on_event)
        _listener_installed = True
    return _num_compiles


def _thread_counts() -> tuple[int, int]:
    return getattr(_this_thread, "compiles", 0), getattr(_this_thread, "cache_hits", 0)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def max_bytes() -> int:
    """The store's size bound, from JAXSERVE_EXECUTABLE_STORE_MAX_GB (default 4)."""
    raw = os.environ.get(MAX_GB_ENV, "").strip()
    try:
        gb = float(raw) if raw else DEFAULT_MAX_GB
    except ValueError:
        log.warning("%s=%r is not a number; using %g", MAX_GB_ENV, raw, DEFAULT_MAX_GB)
        gb = DEFAULT_MAX_GB
    return int(gb * 2**30)


@functools.cache
def code_fingerprint() -> str:
    """A hash of every source file that shapes a traced step, and of what it is traced with."""
    from runtime.worker.cpp_kernels import _cpu_id

    h = hashlib.sha256()
    for folder in TRACED_SOURCES:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and path.is_file():
                h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    import jaxlib

    device = jax.devices()[0]
    parts = [jax.__version__, jaxlib.__version__, sys.version, device.platform, device.device_kind,
             getattr(device.client, "platform_version", ""), os.environ.get("XLA_FLAGS", ""),
             *(f"{name}={jax.config.values.get(name)}" for name in TRACE_OPTIONS)]
    h.update("\0".join(map(str, parts)).encode())
    h.update(_cpu_id())
    return h.hexdigest()


def _describe(args) -> str:
    leaves, tree = jax.tree.flatten(args)
    return repr(tree) + "".join(f"|{tuple(x.shape)}:{x.dtype}" for x in leaves)


def _link(source: Path, tmp: str) -> bool:
    """Puts a hard link to `source` at `tmp` (a file of ours, replaced); False where the file system
    will not (another device, no links): then the caller writes a copy."""
    try:
        os.unlink(tmp)
        os.link(source, tmp)
        return True
    except OSError:
        return False


class ExecutableStore:
    """Executables of one plan on one device, under `directory`, keyed as the module says."""

    def __init__(self, directory: str | os.PathLike, device, *key_parts: str,
                 shared: str | os.PathLike | None = None):
        """`device`: the one device the executables run on (a loaded executable is placed there,
        not on every device the backend has). `shared`: another store's directory that this one
        reads on a miss and also saves into (the module's docstring)."""
        self.directory = Path(directory)
        self.shared = Path(shared) if shared is not None and Path(shared) != self.directory else None
        self.device = device
        from runtime.worker.cpp_kernels import cpu_target

        # The C++ kernels' target picks which kernels a step calls (and their FFI names).
        parts = (code_fingerprint(), f"device {device.id}", f"cpu target {cpu_target()}") + key_parts
        self._base = hashlib.sha256("\0".join(parts).encode()).hexdigest()
        self.hits = 0
        self.shared_hits = 0  # hits found in the shared store only
        self.misses = 0
        self.uncompiled = 0  # misses that JAX's persistent cache served, not stored
        self.evicted = 0
        self.max_bytes = max_bytes()
        self._count = threading.Lock()

    def key(self, what: str, args) -> str:
        return hashlib.sha256(f"{self._base}\0{what}\0{_describe(args)}".encode()).hexdigest()[:32]

    def _path(self, what: str, args) -> Path:
        return self.directory / f"{what}-{self.key(what, args)}.bin"

    def load(self, what: str, *args):
        """The stored executable of `what` for abstract `args`, or None. Safe to call from several
        threads at once: loading an executable is mostly XLA's own work, outside the GIL."""
        from jax.experimental import serialize_executable

        path = self._path(what, args)
        for source in (path, *([self.shared / path.name] if self.shared is not None else [])):
            try:
                blob = source.read_bytes()
            except FileNotFoundError:  # never stored, or evicted (by another process, too)
                continue
            try:
                compiled = serialize_executable.deserialize_and_load(
                    *pickle.loads(blob), backend=self.device.client, execution_devices=[self.device])
            except Exception as e:  # noqa: BLE001  an unreadable entry is a miss, never a failed start
                log.warning("executable store: %s unreadable (%s: %s); removed, compiling again", source,
                            type(e).__name__, e)
                source.unlink(missing_ok=True)  # the next compile XLA does in front of the store replaces it
                continue
            with self._count:
                self.hits += 1
                self.shared_hits += source != path
            try:
                os.utime(source)  # a use: the eviction keeps what was used last
            except OSError:
                pass
            if source != path:
                self._keep(blob, source, path)
            return compiled
        return None

    def compile(self, what: str, jitted, *args):
        """`jitted.lower(*args).compile()`, or the same executable loaded from the store."""
        from jax.experimental import serialize_executable

        compiled = self.load(what, *args)
        if compiled is not None:
            return compiled
        self.misses += 1
        num_backend_compiles()  # the listeners, installed
        lowered = jitted.lower(*args)  # a trace may compile small eager ops of its own: not counted
        compiles, hits = _thread_counts()  # this thread's only: another may compile meanwhile
        compiled = lowered.compile()
        now_compiles, now_hits = _thread_counts()
        if now_compiles == compiles or now_hits != hits:
            # Served by JAX's persistent cache: on XLA:CPU such an executable serializes without
            # its code (it loads, then fails at run time: "Function ... not found"), so only
            # executables XLA has just compiled are stored.
            self.uncompiled += 1
            return compiled
        path = self._path(what, args)
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # noqa: BLE001  an unserializable executable costs the next start only
            log.warning("executable store: could not save %s (%s: %s)", path.name, type(e).__name__, e)
            return compiled
        kept = self._keep(blob, None, path)
        if self.shared is not None:
            self._keep(blob, path if kept else None, self.shared / path.name)
        return compiled

    def _keep(self, blob: bytes, source: Path | None, path: Path) -> bool:
        """Writes the entry `blob` to `path` (a hard link to `source` where there is one and the file
        system allows), then bounds path's directory; whether it was written. A full disk or a
        read-only directory (a plan shipped read-only) costs the next start only."""
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            os.close(fd)
            if source is None or not _link(source, tmp):
                Path(tmp).write_bytes(blob)
            os.replace(tmp, path)  # atomic: processes filling the store at once each write a whole file
            self._evict(path.parent, keep=path)
            return True
        except Exception as e:  # noqa: BLE001
            log.warning("executable store: could not save %s (%s: %s)", path, type(e).__name__, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return False

    def _evict(self, directory: Path, keep: Path) -> None:
        """Removes the least recently used entries (a load or a store is a use) until `directory`
        holds at most `max_bytes`; never `keep`, the entry just written. Entries of older code
        never load again (the code is in their key), so this is what bounds the directory."""
        entries = []
        for p in directory.glob("*.bin"):
            try:
                st = p.stat()
            except FileNotFoundError:  # another process evicted it meanwhile
                continue
            entries.append((st.st_mtime_ns, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            p.unlink(missing_ok=True)
            total -= size
            self.evicted += 1
            log.info("executable store: evicted %s (%.1f MB; the store is bounded at %.1f GB by %s)",
                     p.name, size / 1e6, self.max_bytes / 2**30, MAX_GB_ENV)
