"""Model -> executable plan: lower, run the pass pipeline, size memory, convert weights, AOT-compile buckets.

    python -m runtime.compile --model smollm2-135m --out plans/smollm2
    python -m runtime.compile --model smollm2-135m --dry-run --max-model-len 4096 --memory-utilization 0.5

A plan directory holds plan.json (config, engine options, bucket table, memory plan, content
hash), ir/NN-<pass>.txt (the IR after each pass), the final graph, the weights as an Orbax
checkpoint, the tokenizer, and xla_cache/ (JAX's persistent compilation cache).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ir import Graph, parse_graph, print_graph
from models.config import ModelConfig, PRESETS
from passes.plan_memory import MemoryPlan
from runtime.core.buckets import BucketTable
from runtime.config import EngineConfig
from runtime.planner import PLAN_VERSION, build_graph, is_plan_dir  # noqa: F401 (re-exported)


@dataclass
class Plan:
    """Everything the runtime needs to serve, with no lowering left to do."""

    config: ModelConfig
    engine: EngineConfig
    graph: Graph
    buckets: BucketTable
    memory: MemoryPlan
    pass_texts: list[tuple[str, str]] = field(default_factory=list)
    weights: dict[str, np.ndarray] | None = None  # final params (fused, maybe quantized)
    tokenizer: object | None = None
    directory: Path | None = None
    saved_hash: str | None = None  # content hash read from plan.json

    @property
    def num_kv_blocks(self) -> int:
        return self.memory.num_kv_blocks

    def content_hash(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps(self.config.to_dict(), sort_keys=True).encode())
        h.update(json.dumps(self.engine.to_dict(), sort_keys=True).encode())
        h.update(print_graph(self.graph).encode())
        for name in sorted(self.weights or {}):
            w = self.weights[name]
            h.update(name.encode())
            h.update(np.ascontiguousarray(np.ravel(w)[:1024]).tobytes())  # a cheap fingerprint per tensor
            h.update(str(w.shape).encode())
        return h.hexdigest()[:16]

    def describe(self) -> str:
        lines = [f"model {self.config.name}: {self.config.num_params() / 1e6:.1f}M params, "
                 f"{self.config.num_layers} layers, {self.config.num_q_heads} q heads / "
                 f"{self.config.num_kv_heads} kv heads, dtype {self.engine.dtype}",
                 f"buckets (tokens x seqs): {' '.join(f'{t}x{s}' for t, s in self.buckets.pairs())}",
                 self.memory.table()]
        tp = self.graph.meta_value("tp", 1)
        if tp > 1:
            lines.append(f"  tensor parallel over {tp} devices: attention {self.graph.meta_value('tp_attention')}, "
                         f"MLP and vocab split; replicated weights count fully on every device")
            lines += [f"  note: {n}" for n in self.graph.meta_value("tp_notes", ()) or ()]
        if self.memory.num_kv_blocks * self.engine.block_size < self.engine.max_model_len:
            # Only advice that changes something: no "--dtype bfloat16" for a bf16 plan, no int8 twice.
            shrink = [opt for opt, done in (("--dtype bfloat16", self.engine.dtype != "f32"),
                                            ("--quantization int8", self.engine.quantization == "int8")) if not done]
            lines.append(f"does not fit: the KV cache cannot hold one {self.engine.max_model_len}-token "
                         "sequence; raise --device-memory, --memory-utilization or --tensor-parallel-size, "
                         + (f"use {' or '.join(shrink)}, " if shrink else "") + "or lower --max-model-len")
        return "\n".join(lines)

    # -------------------------------------------------------------- save / load

    def save(self, out: str | os.PathLike, *, weights: bool = True) -> Path:
        from models.weights import save_orbax

        out = Path(out).absolute()
        (out / "ir").mkdir(parents=True, exist_ok=True)
        for i, (name, text) in enumerate(self.pass_texts):
            (out / "ir" / f"{i:02d}-{name}.txt").write_text(text)
        (out / "graph.txt").write_text(print_graph(self.graph))
        if self.weights is not None and weights:
            save_orbax(self.weights, out / "weights", force=True)
        if self.tokenizer is not None:
            self.tokenizer.save(out / "tokenizer")
        meta = {"version": PLAN_VERSION, "config": self.config.to_dict(), "engine": self.engine.to_dict(),
                "buckets": self.buckets.to_dict(), "memory": self.memory.to_dict(),
                "content_hash": self.content_hash()}
        (out / "plan.json").write_text(json.dumps(meta, indent=1))
        self.directory = out
        self.saved_hash = meta["content_hash"]
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike, load_weights: bool = True) -> "Plan":
        from models.tokenizer import Tokenizer
        from models.weights import load_orbax

        d = Path(directory)
        try:
            meta = json.loads((d / "plan.json").read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{d}: not a plan directory (no plan.json)") from None
        if meta.get("version") != PLAN_VERSION:
            raise ValueError(f"{d}/plan.json: plan version {meta.get('version')} != {PLAN_VERSION}; recompile")
        graph = parse_graph((d / "graph.txt").read_text())
        tok = Tokenizer.from_file(d / "tokenizer") if (d / "tokenizer" / "tokenizer.json").exists() else None
        weights = load_orbax(d / "weights") if load_weights and (d / "weights").exists() else None
        return cls(ModelConfig.from_dict(meta["config"]), EngineConfig(**meta["engine"]), graph,
                   BucketTable.from_dict(meta["buckets"]), MemoryPlan.from_dict(meta["memory"]),
                   weights=weights, tokenizer=tok, directory=d.absolute(),
                   saved_hash=meta.get("content_hash"))


def resolve_model(model) -> tuple[ModelConfig, dict | None, object | None]:
    """(config, weights, tokenizer) for a preset name, GGUF file or HF directory."""
    from models.weights import load_model

    return load_model(model)


def compile_plan(model, engine: EngineConfig | None = None, *, progress: bool = False,
                 weights=None, config: ModelConfig | None = None, tokenizer=None) -> Plan:
    """Lowers the model, runs the passes, and materializes the final weights (in memory)."""
    from runtime.worker.params import materialize

    engine = engine or EngineConfig()
    if config is None:
        config, weights, tokenizer = resolve_model(model)
    if engine.max_model_len > config.max_position_embeddings:
        raise ValueError(f"max_model_len {engine.max_model_len} exceeds the model's "
                         f"max_position_embeddings {config.max_position_embeddings}")
    buckets = BucketTable.build(engine.max_num_batched_tokens, engine.max_num_seqs)
    graph, memory, texts = build_graph(config, engine, buckets)
    if memory.num_kv_blocks * engine.block_size < engine.max_model_len:
        raise ValueError(
            f"the KV cache fits {memory.num_kv_blocks} blocks ({memory.num_kv_blocks * engine.block_size} "
            f"tokens), fewer than max_model_len={engine.max_model_len}; raise memory_utilization or "
            f"device_memory, or lower max_model_len\n{memory.table()}")
    final = None
    if weights is not None:
        bar = _progress("convert weights") if progress else None
        final = materialize(graph, weights, progress=bar)
    return Plan(config, engine, graph, buckets, memory, texts, final, tokenizer)


def _progress(desc: str):
    from tqdm import tqdm

    return lambda it: tqdm(it, desc=desc, unit="tensor", file=sys.stderr)


def main(argv=None) -> int:
    from runtime.args import (ArgumentParser, add_engine_args, engine_config_from_args, fit_error,
                              plan_without_weights, preflight)
    from runtime.errors import UserError

    ap = ArgumentParser(prog="python -m runtime.compile", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m",
                    help=f"preset ({', '.join(PRESETS)}), GGUF file or HF directory")
    ap.add_argument("--out", help="plan directory to write")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the memory plan and bucket table without loading weights or compiling; "
                         "exits 2 with the changes that would fit when the plan does not fit")
    add_engine_args(ap)
    args = ap.parse_args(argv)
    if not args.dry_run and not args.out:
        ap.error("--out is required unless --dry-run")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        ap.error(f"--out {args.out} is a file; the plan is a directory")
    # Every user mistake (model, engine args, fit) surfaces here, before weights load or anything compiles.
    config = preflight(args, dry_run=args.dry_run)
    if config is None:
        raise UserError(f"--model {args.model} is already a plan directory; serve it with "
                        f"`jaxserve serve --plan {args.model}`")
    engine = engine_config_from_args(args)
    if args.dry_run:
        graph, memory, buckets = plan_without_weights(config, engine)
        plan = Plan(config, engine, graph, buckets, memory)
        # describe()'s generic "does not fit" advice is replaced by advice checked for this plan.
        print("\n".join(l for l in plan.describe().splitlines() if not l.startswith("does not fit:")))
        error = fit_error(config, engine, memory)
        if error:
            raise error
        return 0
    t0 = time.perf_counter()
    plan = compile_plan(args.model, engine, progress=True)
    out = plan.save(args.out)
    from runtime.worker.model_runner import ModelRunner

    runner = ModelRunner(plan, cache_dir=out / "xla_cache")
    runner.warmup(progress=True)
    plan.memory = runner.memory_with_xla(plan.memory)
    plan.save(out, weights=False)  # rewrite plan.json with XLA's own numbers next to ours
    print(plan.describe())
    print(f"plan written to {out} in {time.perf_counter() - t0:.1f}s "
          f"(hash {json.loads((out / 'plan.json').read_text())['content_hash']})")
    return 0


if __name__ == "__main__":
    from runtime.errors import run_main

    sys.exit(run_main(main))
