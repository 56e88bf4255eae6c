"""`python -m runtime.compile`: a model config to an executable plan directory (see runtime/engine/plan.py).

    python -m runtime.compile --model smollm2-135m --out plans/smollm2
    python -m runtime.compile --model smollm2-135m --dry-run --max-model-len 4096 --memory-utilization 0.5

Writes the plan (runtime.engine.plan.Plan.save), then compiles every bucket into the plan's xla_cache/, or
loads it from the per-user executable store where `jaxserve serve --model` (or an earlier compile)
already compiled it with the same flags.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from models.config import PRESETS
from config.engine_config import PLATFORMS, planning_for
from runtime.engine.plan import Plan, compile_plan


def main(argv=None) -> int:
    from runtime.entrypoints.args import ArgumentParser, add_engine_args

    ap = ArgumentParser(prog="python -m runtime.compile", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m",
                    help=f"preset ({', '.join(PRESETS)}), GGUF file or HF directory")
    ap.add_argument("--out", help="plan directory to write")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the memory plan and bucket table without loading weights or compiling; "
                         "exits 2 with the changes that would fit when the plan does not fit")
    ap.add_argument("--platform", choices=PLATFORMS,
                    help="with --dry-run: plan as on this platform's lowerings (default: this machine's), for "
                         "example a GPU's from a laptop; needs --device-memory")
    add_engine_args(ap)
    args = ap.parse_args(argv)
    if not args.dry_run and not args.out:
        ap.error("--out is required unless --dry-run")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        ap.error(f"--out {args.out} is a file; the plan is a directory")
    if args.platform and not args.dry_run:
        ap.error("--platform plans for another machine: it needs --dry-run")
    if args.platform and args.device_memory is None:
        ap.error(f"--platform {args.platform}: give that device's memory with --device-memory (e.g. 80 for an H100)")
    with planning_for(args.platform):
        return _main(args)


def _main(args) -> int:
    from runtime.entrypoints.args import (engine_config_from_args, fit_error, model_block_formats, plan_without_weights,
                              preflight)
    from runtime.errors import UserError

    # Every user mistake (model, engine args, fit) surfaces here, before weights load or anything compiles.
    config = preflight(args, dry_run=args.dry_run)
    if config is None:
        raise UserError(f"--model {args.model} is already a plan directory; serve it with "
                        f"`jaxserve serve --plan {args.model}`")
    engine = engine_config_from_args(args)
    if args.dry_run:
        formats = model_block_formats(args.model)
        graph, memory, buckets = plan_without_weights(config, engine, formats)
        plan = Plan(config, engine, graph, buckets, memory)
        # describe()'s generic "does not fit" advice is replaced by advice checked for this plan.
        print("\n".join(l for l in plan.describe().splitlines() if not l.startswith("does not fit:")))
        error = fit_error(config, engine, memory, formats)
        if error:
            raise error
        return 0
    t0 = time.perf_counter()
    plan = compile_plan(args.model, engine, progress=True)
    out = plan.save(args.out)
    from runtime.engine.build import build_runner

    # Backed by the per-user store: what `serve --model` compiled for these flags loads, not compiles.
    runner = build_runner(plan, out / "xla_cache", share_user_store=True)
    runner.warmup(progress=True)  # sizes the KV pool from XLA's measured peak (plan.memory)
    plan.save(out, weights=False)  # rewrite plan.json with XLA's own numbers next to ours
    print(plan.describe())
    print(f"plan written to {out} in {time.perf_counter() - t0:.1f}s "
          f"(hash {json.loads((out / 'plan.json').read_text())['content_hash']})")
    return 0


if __name__ == "__main__":
    from runtime.errors import run_main

    sys.exit(run_main(main))
