"""Two engine configurations of SmolLM2-135M (f32 plan, greedy, CPU) in one process: two engines
over the same weights, rounds interleaved, medians, the variant's speedup over the base.

    .venv/bin/python benchmarks/bench_ab.py [--base KEY=VALUE ...] [--variant KEY=VALUE ...]
                                         [--rounds 3] [--cases ttft,batch1,seqs64,long,long1,mixed1]
                                         [--base-kernels DIR] [--base-sampler FILE]
                                         [--base-decode-part-tokens N] [--base-decode-group-rows N]
                                         [--base-f32-max-rows N]
                                         [--long1-context 3000]
                                         [--temperature T --top-p P --seed S]

KEY=VALUE pairs are EngineConfig fields. The default variant is `matmul_precision=bfloat16` against
the default engine (what this script measured under its old name, bench_matmul_precision.py).
With `--base-kernels DIR`, the base engine is built with another checkout's attention lowerings
(DIR/runtime/worker/kernels.py), so that a change to them is measured against the old code in the
same process; the variant's config is then the base's unless `--variant` says otherwise.
`--base-sampler FILE` does the same for the sampler (another checkout's runtime/worker/sampler.py).
`--base-decode-part-tokens N` builds the base engine with the C++ decode kernel splitting long rows
into parts of at least N tokens (0: never; see cpp_kernels.PART_TOKENS), the variant with the default;
`--base-decode-group-rows N` with up to N rows of a prompt walking its blocks together (1: each row
alone; see cpp_kernels.GROUP_ROWS).
`--base-f32-max-rows N` builds the base engine with f32 products of at most N rows in the C++ kernel
(0: XLA's products only; see kernels.CPP_F32_MAX_ROWS), the variant with the default.
Requests are greedy unless `--temperature` (and `--top-p`) say otherwise; sampled requests all take
`--seed`, so both engines see the same requests.
Both engines run without prefix caching (every round's prompts are new anyway) and with 2,000
KV blocks each, unless told otherwise. Cases:
- ttft: TTFT of a `--ttft-tokens` (512) token prompt (`max_tokens=1`, a new prompt each round);
- batch1: batch-1 decode rate, 128 tokens after a 32-token prompt (`ignore_eos`);
- seqs64: 64 sequences x 64 tokens, end to end (prefill included); with the share of the 64
  sequences whose greedy tokens agree between the two engines (first round);
- long: decode rate of 32 sequences at 384-512 tokens of context: the same 32 prompts of 384
  tokens run to 1 and to 129 tokens, and the difference is 128 decode steps;
- long1: batch-1 decode rate at long context: one prompt of `--long1-context` tokens run to 1 and
  to 129 tokens (128 decode steps); max_model_len grows to fit it. Pass enable_prefix_caching=true
  to both engines to take the prompt's prefill out of both timings (a first untimed call caches it).
- mixed1: decode rate of 16 sequences, 15 after 32-token prompts and one after a `--long1-context`
  prompt (a long chat among short ones), run to 1 and to 129 tokens; the same note on prefix caching.
Run on a quiet machine (uptime < 1); prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The base engine may trace swapped modules (--base-kernels, --base-sampler, --base-decode-*, ...)
# that the executable store's key cannot see (runtime/worker/executables.py): compile every engine.
os.environ["JAXSERVE_EXECUTABLE_STORE"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_engine_args; bench_xla_attention, for --base-kernels

import numpy as np  # noqa: E402

from models.weights import load_model  # noqa: E402
from runtime import SamplingParams  # noqa: E402
from config.engine_config import EngineConfig  # noqa: E402
from runtime.entrypoints.llm import LLM  # noqa: E402
from runtime.engine.plan import compile_plan  # noqa: E402

from bench_engine_args import COMMON, parse_pairs  # noqa: E402

CASES = ("ttft", "batch1", "seqs64", "long", "long1", "mixed1")


@contextlib.contextmanager
def base_kernels(root: Path | None):
    """While open, the engine's attention lowerings come from `root`'s kernels module (if given)."""
    if root is None:
        yield
        return
    from bench_xla_attention import load_baseline
    from runtime.worker import kernels
    saved, kernels.lowerings = kernels.lowerings, load_baseline(root.resolve()).lowerings
    try:
        yield
    finally:
        kernels.lowerings = saved


@contextlib.contextmanager
def base_sampler(path: Path | None):
    """While open, the step executables trace `path`'s sample_rows (another sampler.py), if given."""
    if path is None:
        yield
        return
    import importlib.util

    from runtime.worker import sampler
    spec = importlib.util.spec_from_file_location("sampler_baseline", path)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old
    spec.loader.exec_module(old)
    saved, sampler.sample_rows = sampler.sample_rows, old.sample_rows
    try:
        yield
    finally:
        sampler.sample_rows = saved


@contextlib.contextmanager
def base_decode_attrs(**attrs):
    """While open, the C++ decode kernel's calls take these attributes (part_tokens: split long rows
    into parts of at least that many tokens; group_rows: walk up to that many rows of a prompt
    together); None leaves one as it is."""
    attrs = {k: v for k, v in attrs.items() if v is not None}
    if not attrs:
        yield
        return
    from runtime.worker import cpp_kernels
    saved = cpp_kernels.paged_decode
    cpp_kernels.paged_decode = lambda *a, **kw: saved(*a, **(kw | attrs))
    try:
        yield
    finally:
        cpp_kernels.paged_decode = saved


@contextlib.contextmanager
def base_f32_max_rows(n: int | None):
    """While open, f32 products of at most `n` rows take the C++ kernel (0: none)."""
    if n is None:
        yield
        return
    from runtime.worker import kernels
    saved, kernels.CPP_F32_MAX_ROWS = kernels.CPP_F32_MAX_ROWS, n
    try:
        yield
    finally:
        kernels.CPP_F32_MAX_ROWS = saved


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("--variant", nargs="*", default=None, metavar="KEY=VALUE")
    ap.add_argument("--base-kernels", type=Path, default=None, metavar="DIR",
                    help="build the base engine with DIR's runtime/worker/kernels.py (another checkout)")
    ap.add_argument("--base-sampler", type=Path, default=None, metavar="FILE",
                    help="build the base engine with FILE as runtime/worker/sampler.py (another checkout's)")
    ap.add_argument("--base-decode-group-rows", type=int, default=None, metavar="N",
                    help="build the base engine with the C++ decode kernel's group_rows=N (1: each row alone)")
    ap.add_argument("--base-decode-part-tokens", type=int, default=None, metavar="N",
                    help="build the base engine with the C++ decode kernel's part_tokens=N (0: no split)")
    ap.add_argument("--base-f32-max-rows", type=int, default=None, metavar="N",
                    help="build the base engine with f32 products of at most N rows in the C++ kernel (0: none)")
    ap.add_argument("--long1-context", type=int, default=3000, help="the long1 case's prompt length")
    ap.add_argument("--ttft-tokens", type=int, default=512, help="the ttft case's prompt length")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="ttft,batch1,seqs64", help=f"comma-separated, of {', '.join(CASES)}")
    args = ap.parse_args()
    cases = args.cases.split(",")
    if set(cases) - set(CASES):
        raise SystemExit(f"unknown case(s) {sorted(set(cases) - set(CASES))}; known: {', '.join(CASES)}")
    if args.variant is None:
        swapped = (args.base_kernels or args.base_sampler or args.base_decode_part_tokens is not None
                   or args.base_decode_group_rows is not None
                   or args.base_f32_max_rows is not None)
        args.variant = args.base if swapped else ["matmul_precision=bfloat16"]
    longest = max([args.long1_context if {"long1", "mixed1"} & set(cases) else 0,
                   args.ttft_tokens if "ttft" in cases else 0])
    common = COMMON | {"max_model_len": max(COMMON["max_model_len"], longest + 256)}
    configs = {"base": common | parse_pairs(args.base), "variant": common | parse_pairs(args.variant)}
    print(json.dumps({"configs": configs}), flush=True)
    cfg, weights, tok = load_model("smollm2-135m")
    llms = {}
    for name, kw in configs.items():
        with (base_kernels(args.base_kernels if name == "base" else None),  # engines compile as they are built
              base_sampler(args.base_sampler if name == "base" else None),
              base_decode_attrs(part_tokens=args.base_decode_part_tokens if name == "base" else None,
                                group_rows=args.base_decode_group_rows if name == "base" else None),
              base_f32_max_rows(args.base_f32_max_rows if name == "base" else None)):
            llms[name] = LLM.from_plan(compile_plan(None, EngineConfig(**kw), weights=weights, config=cfg,
                                                    tokenizer=tok))
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(100, 40000, n).tolist()  # noqa: E731

    def params(m):  # every case's requests: greedy unless --temperature says otherwise
        if args.temperature == 0:
            return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=m,
                              ignore_eos=True)

    def report(name, runs, unit, higher_is_better, **extra):
        med = {p: statistics.median(v) for p, v in runs.items()}
        ratio = med["variant"] / med["base"] if higher_is_better else med["base"] / med["variant"]
        print(json.dumps({"case": name, "unit": unit, **{p: round(m, 3) for p, m in med.items()},
                          "variant_speedup": round(ratio, 2),
                          "rounds": {p: [round(x, 3) for x in v] for p, v in runs.items()},
                          "load_avg_1m": round(os.getloadavg()[0], 2), **extra}), flush=True)

    if "ttft" in cases:
        runs = {p: [] for p in llms}
        for llm in llms.values():
            llm.generate([prompt(args.ttft_tokens)], params(1))
        for _ in range(args.rounds):
            p = prompt(args.ttft_tokens)
            for name, llm in llms.items():
                runs[name].append(timed(lambda: llm.generate([p], params(1))))
        report(f"TTFT, {args.ttft_tokens}-token prompt", runs, "s", higher_is_better=False)

    if "batch1" in cases:
        p = prompt(32)
        runs = {p: [] for p in llms}
        for llm in llms.values():
            llm.generate([p], params(128))
        for _ in range(args.rounds):
            for name, llm in llms.items():
                ttft = timed(lambda: llm.generate([p], params(1)))
                runs[name].append(127 / (timed(lambda: llm.generate([p], params(128))) - ttft))
        report("batch-1 decode", runs, "tok/s", higher_is_better=True)

    if "seqs64" in cases:
        runs = {p: [] for p in llms}
        for llm in llms.values():
            llm.generate([prompt(64) for _ in range(64)], params(64))
        same = None
        for _ in range(args.rounds):
            prompts = [prompt(64) for _ in range(64)]
            outs = {}
            for name, llm in llms.items():
                runs[name].append(64 * 64 / timed(lambda: outs.__setitem__(name, llm.generate(prompts, params(64)))))
            if same is None:
                same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
                           for a, b in zip(outs["base"], outs["variant"]))
        report("64 sequences x 64 tokens", runs, "tok/s", higher_is_better=True, same_greedy_tokens=f"{same}/64")

    if "long" in cases:
        runs = {p: [] for p in llms}
        for llm in llms.values():
            llm.generate([prompt(384) for _ in range(32)], params(8))
        for _ in range(args.rounds):
            prompts = [prompt(384) for _ in range(32)]
            for name, llm in llms.items():
                first = timed(lambda: llm.generate(prompts, params(1)))
                runs[name].append(32 * 128 / (timed(lambda: llm.generate(prompts, params(129))) - first))
        report("32 sequences decoding at 384-512 tokens of context", runs, "tok/s", higher_is_better=True)

    if "long1" in cases:
        n = args.long1_context
        runs = {p: [] for p in llms}
        for llm in llms.values():
            llm.generate([prompt(n)], params(8))
        for _ in range(args.rounds):
            p = prompt(n)
            for name, llm in llms.items():
                llm.generate([p], params(1))  # with enable_prefix_caching=true, the two timed calls hit
                first = timed(lambda: llm.generate([p], params(1)))
                runs[name].append(128 / (timed(lambda: llm.generate([p], params(129))) - first))
        report(f"batch-1 decode at {n}-{n + 128} tokens of context", runs, "tok/s", higher_is_better=True)

    if "mixed1" in cases:
        n = args.long1_context
        runs = {p: [] for p in llms}
        for llm in llms.values():
            llm.generate([prompt(32) for _ in range(15)] + [prompt(n)], params(8))
        for _ in range(args.rounds):
            ps = [prompt(32) for _ in range(15)] + [prompt(n)]
            for name, llm in llms.items():
                llm.generate(ps, params(1))
                first = timed(lambda: llm.generate(ps, params(1)))
                runs[name].append(16 * 128 / (timed(lambda: llm.generate(ps, params(129))) - first))
        report(f"16 sequences decoding, 15 at 32-160 tokens of context and one at {n}-{n + 128}", runs, "tok/s",
               higher_is_better=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
