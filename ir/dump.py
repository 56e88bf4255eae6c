"""Prints the IR of a model after each compiler pass, without loading any weights.

    python -m ir.dump --model smollm2-135m                      # the final IR
    python -m ir.dump --model smollm2-135m --after fuse_attention
    python -m ir.dump --model llama-2-70b --after-each --stats   # every pass, op counts, memory plan
    python -m ir.dump --model tiny --after-each --dump-dir /tmp/ir  # also writes /tmp/ir/NN-<pass>.txt
    python -m ir.dump --model smollm2-135m --stats --bucket tokens=128,seqs=16

The IR only needs the model config, so this works for every preset (and for an HF directory's
config.json). The output is deterministic: the same arguments give the same bytes.

This is the one module in `ir/` that imports `models` and `passes`: it is a command-line face
of the compiler, not part of the IR core.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ir.graph import Graph
from ir.printer import print_graph

# With no --bucket, the memory plan covers the largest prefill bucket and the largest decode
# bucket of the default engine (vLLM's max_num_batched_tokens / max_num_seqs defaults).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
DEFAULT_MAX_NUM_SEQS = 64
# A CPU has no device memory to measure; the engine assumes 4 GiB there (runtime.config).
DEFAULT_DEVICE_MEMORY = 4 << 30

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "mb": 10**6, "kb": 10**3, "t": 1 << 40,
          "tib": 1 << 40}


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


def parse_bytes(text: str) -> int:
    """`4GiB`, `80g`, `1073741824` -> bytes."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; expected e.g. 4GiB, 80g or a byte count")
    return int(float(num) * _UNITS[unit])


def resolve_config(model: str):
    """A preset name, an HF directory / config.json, or a .gguf file (only the config is read)."""
    from models.config import PRESETS, config_from_hf, get_preset

    if model in PRESETS:
        return get_preset(model)
    path = Path(model)
    if path.is_dir() or path.name == "config.json":
        return config_from_hf(path)
    if path.suffix == ".gguf" and path.is_file():
        from models.config import config_from_gguf_fields
        from models.weights import read_gguf_fields

        reader, fields = read_gguf_fields(path)  # metadata only; tensors are not dequantized
        tensors = {t.name for t in reader.tensors}
        config = config_from_gguf_fields(dict(fields, _tied="output.weight" not in tensors), name=path.stem)
        return config.replace(qkv_bias="blk.0.attn_q.bias" in tensors)
    raise SystemExit(f"error: unknown model {model!r}; presets: {', '.join(sorted(PRESETS))} "
                     "(or an HF directory with config.json)")


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
    ap = argparse.ArgumentParser(prog="python -m ir.dump", description=__doc__,
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
    ap.add_argument("--dtype", default="f32", choices=("f32", "bf16"))
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--quantization", choices=("int8",), default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: min(2048, the model's max_position_embeddings)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    ap.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    ap.add_argument("--memory-utilization", type=float, default=0.9)
    ap.add_argument("--device-memory", type=parse_bytes, default=DEFAULT_DEVICE_MEMORY,
                    help="device memory for the plan, e.g. 80GiB (default 4GiB, the CPU budget)")
    ap.add_argument("--reserve", type=parse_bytes, default=64 << 20, help="bytes kept free (default 64MiB)")
    return ap


def run(args) -> tuple[list[tuple[str, Graph]], object | None]:
    """Lowers and runs the pipeline; returns [(stage name, graph)] starting with `lower`, and the plan."""
    from models.llama import lower
    from passes.pipeline import PipelineOptions, memory_report, run_pipeline

    config = resolve_config(args.model)
    max_model_len = args.max_model_len or min(2048, config.max_position_embeddings)
    buckets = tuple(args.bucket) if args.bucket else tuple(sorted({
        (args.max_num_batched_tokens, min(args.max_num_seqs, args.max_num_batched_tokens)),
        (min(args.max_num_seqs, args.max_num_batched_tokens),) * 2}))
    opts = PipelineOptions(block_size=args.block_size, max_model_len=max_model_len, buckets=buckets,
                           device_memory_bytes=args.device_memory,
                           memory_utilization=args.memory_utilization, reserve_bytes=args.reserve,
                           quantization=args.quantization,
                           tensor_parallel_size=args.tensor_parallel_size)
    graph = lower(config, args.dtype)
    stages = [("lower", graph)]
    final = run_pipeline(graph, opts, on_pass=lambda i, name, g: stages.append((name, g)))
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
        stats = op_count_table(stages) + "\n\n" + plan.table() + "\n"
        chunks.append(stats)
        if args.dump_dir:
            (Path(args.dump_dir) / "stats.txt").write_text(stats)
    sys.stdout.write("\n".join(chunks))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `| head` closed the pipe
        sys.exit(0)
