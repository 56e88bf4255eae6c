"""Engine arguments on the command line (shared by serve, compile and bench), with vLLM's flag names."""

from __future__ import annotations

import argparse

from runtime.config import EngineConfig


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {v!r}")


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = ap.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--memory-utilization", "--gpu-memory-utilization", dest="memory_utilization",
                   type=float, default=d.memory_utilization)
    g.add_argument("--device-memory", type=float, default=None,
                   help="device memory in GiB to plan for (default: measured on GPU, 4 GiB on CPU)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="override the planned KV block count")
    g.add_argument("--dtype", default="auto", help="auto (default: bfloat16 on GPU, float32 on CPU), float32 or bfloat16")
    g.add_argument("--enable-prefix-caching", type=_bool, default=d.enable_prefix_caching)
    g.add_argument("--enable-chunked-prefill", type=_bool, default=d.enable_chunked_prefill)
    g.add_argument("--scheduling", default=d.scheduling, help="continuous (default), dynamic or static")
    g.add_argument("--max-waiting-ms", type=float, default=d.max_waiting_ms)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size)
    g.add_argument("--quantization", default=None, choices=(None, "int8"))
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--kernel-backend", default=d.kernel_backend, choices=("auto", "xla", "pallas", "interpret"))


ENGINE_FIELDS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "memory_utilization", "dtype", "enable_prefix_caching", "enable_chunked_prefill",
                 "scheduling", "max_waiting_ms", "tensor_parallel_size", "quantization", "seed",
                 "num_kv_blocks", "kernel_backend")


def engine_kwargs_from_args(args) -> dict:
    kw = {f: getattr(args, f) for f in ENGINE_FIELDS}
    if args.device_memory:
        kw["device_memory"] = int(args.device_memory * (1 << 30))
    return kw


def engine_config_from_args(args) -> EngineConfig:
    return EngineConfig.from_kwargs(**engine_kwargs_from_args(args))
