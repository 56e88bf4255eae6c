"""Prints the IR of a model after each compiler pass, without loading any weights.

    python -m ir.dump --model smollm2-135m                      # the final IR
    python -m ir.dump --model smollm2-135m --after fuse_attention
    python -m ir.dump --model llama-2-70b --after-each --stats   # every pass, op counts, memory plan
    python -m ir.dump --model tiny --after-each --dump-dir /tmp/ir  # also writes /tmp/ir/NN-<pass>.txt
    python -m ir.dump --model smollm2-135m --stats --bucket tokens=128,seqs=16

The IR only needs the model config, so this works for every preset (and for an HF directory's
config.json). The output is deterministic: the same arguments give the same bytes.

This is the one module in `ir/` that imports `models` and `passes` (among them the command-line
basics every CLI shares, `config.flags`: flag names, units, one-line errors): it is a command-line
face of the compiler, not part of the IR core.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ir.graph import Graph
from ir.printer import print_graph
from config.flags import (ArgumentParser, UserError, add_engine_args, check_max_model_len, parse_memory,
                        resolve_model_config, run_main)
from config.engine_config import CPU_DEVICE_MEMORY, EngineConfig

# Engine flags shared with every other CLI (config.flags: names, units, dtype aliases). A dump
# plans for the CPU budget and float32 unless told otherwise, so its output doesn't depend on the
# machine it runs on.
DUMP_ENGINE_FIELDS = ("dtype", "kv_cache_dtype", "tensor_parallel_size", "enable_expert_parallel", "quantization",
                      "matmul_precision",
                      "block_size", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
                      "memory_utilization", "device_memory", "gguf_blocks", "gguf_activations", "gguf_tiles")


# Why `jaxserve serve` may print other weights than a dump (SmolLM2: 513.1 MiB here, 217.8 MiB in
# the server on a CPU with AMX-BF16): the engine's defaults for GGUF blocks and tiles depend on the
# machine's kernels, and a dump must not.
MACHINE_NOTE = (
    "note: a dump does not depend on the machine: a GGUF model's blocks and tiles (--gguf-blocks, --gguf-tiles,\n"
    "--gguf-activations) count only when asked for, and --device-memory is 4 GiB unless given. The server\n"
    "turns them on where this CPU's kernels run them (tiles replace the f32 weights: SmolLM2's 513 MiB become\n"
    "92 MiB), so its plan may differ; `jaxserve compile --model M --dry-run` shows the plan for this machine.")


def parse_bucket(text: str) -> tuple[int, int]:
    """`tokens=N,seqs=M` (or `N,M` / `NxM`) -> (N, M)."""
    parts = dict.fromkeys(("tokens", "seqs"))
    items = text.replace("x", ",").split(",")
    try:
        if all("=" not in x for x in items) and len(items) == 2:
            parts["tokens"], parts["seqs"] = (int(x) for x in items)
        else:
            for item in items:
                key, _, value = item.partition("=")
                key = key.strip()
                if key not in parts:
                    raise ValueError(f"unknown key {key!r}")
                parts[key] = int(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad bucket {text!r} ({e}); expected tokens=N,seqs=M") from None
    if parts["tokens"] is None or parts["seqs"] is None:
        raise argparse.ArgumentTypeError(f"bad bucket {text!r}; expected tokens=N,seqs=M")
    t, s = parts["tokens"], parts["seqs"]
    if t < 1 or s < 1 or s > t:
        raise argparse.ArgumentTypeError(f"bad bucket {text!r}: need 1 <= seqs <= tokens")
    return t, s


def op_count_table(stages: list[tuple[str, Graph]]) -> str:
    """Ops (rows) by pass (columns): how each pass changed the graph."""
    counts = [g.op_counts() for _, g in stages]
    ops = sorted({op for c in counts for op in c})
    width = max([len("op")] + [len(op) for op in ops])
    cols = [max(len(name), 6) for name, _ in stages]
    head = "op".ljust(width) + "".join(f"  {name:>{w}}" for (name, _), w in zip(stages, cols))
    lines = ["op counts per pass", head]
    for op in ops:
        lines.append(op.ljust(width) + "".join(f"  {c.get(op, 0):>{w}}" for c, w in zip(counts, cols)))
    totals = [sum(c.values()) for c in counts]
    lines.append("total".ljust(width) + "".join(f"  {n:>{w}}" for n, w in zip(totals, cols)))
    params = [len(g.params) for _, g in stages]
    lines.append("params".ljust(width) + "".join(f"  {n:>{w}}" for n, w in zip(params, cols)))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m ir.dump", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="preset name, or an HF directory (config only)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--after", metavar="PASS", help="print the IR after this pass ('lower' = before any)")
    which.add_argument("--after-each", action="store_true", help="print the IR after every pass")
    ap.add_argument("--bucket", action="append", type=parse_bucket, metavar="tokens=N,seqs=M",
                    help="bucket(s) to plan memory for (repeatable); default: the largest prefill "
                         "and decode buckets of the default engine")
    ap.add_argument("--dump-dir", metavar="DIR", help="also write DIR/NN-<pass>.txt for every pass")
    ap.add_argument("--stats", action="store_true", help="op counts per pass and the memory plan")
    ap.add_argument("--no-ir", action="store_true", help="print no IR (with --stats: only the stats)")
    add_engine_args(ap, only=DUMP_ENGINE_FIELDS,
                    defaults={"dtype": "float32", "max_model_len": None, "device_memory": CPU_DEVICE_MEMORY})
    ap.add_argument("--reserve", type=parse_memory, default=64 << 20, metavar="SIZE",
                    help="memory kept free: 64MiB (the default); a bare number is GiB")
    return ap


def run(args) -> tuple[list[tuple[str, Graph]], object | None]:
    """Lowers and runs the pipeline; returns [(stage name, graph)] starting with `lower`, and the plan."""
    from models.llama import lower
    from passes.pipeline import PipelineOptions, memory_report, run_pipeline

    config = resolve_model_config(args.model, need_weights=False)
    max_model_len = args.max_model_len or min(EngineConfig().max_model_len, config.max_position_embeddings)
    check_max_model_len(config, max_model_len)
    buckets = tuple(args.bucket) if args.bucket else tuple(sorted({
        (args.max_num_batched_tokens, min(args.max_num_seqs, args.max_num_batched_tokens)),
        (min(args.max_num_seqs, args.max_num_batched_tokens),) * 2}))
    dtypes = EngineConfig(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)  # the model's and the KV pools'
    # GGUF blocks only when asked (`--gguf-blocks true`): the engine's auto depends on the machine's
    # kernels, and a dump must not. Their formats come from the GGUF header, no weights loaded.
    formats = {}
    if args.gguf_blocks or args.gguf_tiles or args.gguf_activations == "q8":
        from models.weights import gguf_block_formats

        formats = gguf_block_formats(args.model)
        if not formats:
            raise UserError(f"--gguf-blocks true / --gguf-tiles true / --gguf-activations q8: {args.model} brings no GGUF blocks (a preset or .gguf file "
                            f"whose matrices are Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K)")
    opts = PipelineOptions(block_size=args.block_size, max_model_len=max_model_len, buckets=buckets,
                           device_memory_bytes=args.device_memory,
                           memory_utilization=args.memory_utilization, reserve_bytes=args.reserve,
                           quantization=args.quantization, matmul_precision=args.matmul_precision,
                           kv_dtype=dtypes.kv_dtype(), block_formats=tuple(sorted(formats.items())),
                           block_tiles="q8" if args.gguf_activations == "q8" else "f32" if args.gguf_tiles else None,
                           tensor_parallel_size=args.tensor_parallel_size,
                           expert_parallel=bool(args.enable_expert_parallel))
    graph = lower(config, dtypes.dtype)
    stages = [("lower", graph)]
    try:
        final = run_pipeline(graph, opts, on_pass=lambda i, name, g: stages.append((name, g)))
    except ValueError as e:  # a pass refuses options that don't suit the model (e.g. its tp sizes)
        raise UserError(f"{config.name}: {e}") from e
    return stages, memory_report(final, opts) if args.stats else None


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    stages, plan = run(args)
    names = [name for name, _ in stages]
    if args.after is not None and args.after not in names:
        ap.error(f"unknown pass {args.after!r}; passes: {', '.join(names)}")

    texts = [(name, print_graph(g)) for name, g in stages]
    if args.dump_dir:
        out = Path(args.dump_dir)
        out.mkdir(parents=True, exist_ok=True)
        for i, (name, text) in enumerate(texts):
            (out / f"{i:02d}-{name}.txt").write_text(text)

    if args.after_each:
        shown = texts
    elif args.after is not None:
        shown = [texts[names.index(args.after)]]
    else:
        shown = [texts[-1]]
    chunks = [] if args.no_ir else [f"IR after {name}:\n{text}" for name, text in shown]
    if args.stats:
        stats = op_count_table(stages) + "\n\n" + plan.table() + "\n" + MACHINE_NOTE + "\n"
        chunks.append(stats)
        if args.dump_dir:
            (Path(args.dump_dir) / "stats.txt").write_text(stats)
    sys.stdout.write("\n".join(chunks))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(run_main(main))
    except BrokenPipeError:  # `| head` closed the pipe
        sys.exit(0)
