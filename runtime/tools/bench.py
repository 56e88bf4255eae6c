"""Offline throughput benchmark (and, against a running server, `serve` and `soak`).

    python -m runtime.bench --model smollm2-135m --workload mixed --num-prompts 64
    python -m runtime.bench --scheduling static,dynamic,continuous --baseline hf --plot bench.png
    python -m runtime.bench --request-rate 1.0 --max-num-seqs 16      # arrivals as at a server: TTFT
    python -m runtime.bench --structured-fraction 0.5 --num-prompts 32  # the cost of JSON-schema masks
    python -m runtime.bench serve --url http://127.0.0.1:8000 --request-rate 4 --num-prompts 64
    python -m runtime.bench soak --duration-min 10 --serve-args "--max-model-len 512"

All policies run on the same seeded workload in one process, over one compiled plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from runtime.tools.workload import WORKLOADS, make_workload


@dataclass
class RunResult:
    name: str
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    kv_fill_mean: float  # tokens / slots of allocated blocks, over steps
    kv_fill_peak: float
    kv_pool_mean: float  # tokens / all slots of the pool
    kv_pool_peak: float
    recompiles: int = 0
    num_steps: int = 0
    padding: dict = field(default_factory=dict)  # bucket -> (steps, real tokens, padded tokens)
    # Medians per step, ms (engine.StepTrace): schedule, prepare inputs, dispatch, device wait, post.
    breakdown_ms: dict = field(default_factory=dict)
    timeline: list = field(default_factory=list)  # (t, output tok/s, kv pool occupancy)
    spec: tuple[int, int, int] | None = None  # speculative decoding: (drafts, draft tokens, accepted tokens)
    ttft_s: list = field(default_factory=list)  # per request, when requests arrive at a rate
    # A digest of the steps run (bucket, tokens, sequences sampled): two policies with one digest ran
    # one identical schedule, and their throughputs differ only by noise.
    schedule: str = ""

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s


def arrival_times(num: int, request_rate: float, seed: int = 0) -> np.ndarray:
    """Seconds after the start at which each request arrives: Poisson arrivals at `request_rate`
    requests/s (the seeded gaps `bench serve` draws), or all at once when it is inf."""
    if math.isinf(request_rate):
        return np.zeros(num)
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / request_rate, size=num))


def json_digits_schema(num_tokens: int) -> dict:
    """A JSON array of exactly `num_tokens` digits: every item costs at least one token, so a request
    constrained to it runs to its max_tokens as a free one (ignore_eos) does, and the two runs
    generate the same tokens in the same steps: tok/s then compares the step cost alone (the host
    writing masks, the masked sampler)."""
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": num_tokens, "maxItems": num_tokens}


def constrained_requests(num: int, fraction: float) -> list[bool]:
    """Which of `num` requests are constrained: round(num x fraction), spread evenly."""
    k = round(num * fraction)
    return [(i * k) // num != ((i + 1) * k) // num for i in range(num)]


def run_engine(plan, runner, policy: str, work, tokenizer, request_traces: list | None = None, *,
               request_rate: float = math.inf, structured_fraction: float = 0.0, schema_items: int | None = None,
               name: str | None = None) -> RunResult:
    """One policy over the workload; with `request_traces`, every request runs with
    SamplingParams(trace=True) and its trace is appended there. `request_rate`: requests arrive at
    this rate (Poisson, seeded) instead of all at once, as they would at a server, without HTTP.
    `structured_fraction`: that share of the requests is constrained to json_digits_schema
    (`schema_items` long: by default the workload's longest max_tokens)."""
    from runtime.engine.build import build_engine
    from runtime.core.sampling_params import SamplingParams

    plan = dataclasses.replace(plan, engine=dataclasses.replace(plan.engine, scheduling=policy))
    engine = build_engine(plan, runner=runner, tokenizer=tokenizer, warmup=False)
    engine.trace = []
    schema = {"json": json_digits_schema(schema_items or max(m for _, m in work)), "disable_any_whitespace": True}
    constrained = constrained_requests(len(work), structured_fraction)
    timed = not math.isinf(request_rate)  # TTFT is what arrivals at a rate are for
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                             trace=request_traces is not None or timed,
                             structured_outputs=schema if constrained[i] else None)
              for i, (_, max_tokens) in enumerate(work)]
    arrivals = arrival_times(len(work), request_rate)
    t0 = time.monotonic()
    added = 0
    out_tokens, ttft = 0, []
    while added < len(work) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while added < len(work) and arrivals[added] <= now:
            engine.add_request(f"{policy}-{added}", work[added][0], params[added], arrival_time=t0 + arrivals[added])
            added += 1
        engine.scheduler.no_more_arrivals = added == len(work)  # static/dynamic batching stop waiting
        if not engine.has_unfinished_requests():
            time.sleep(min(max(arrivals[added] - now, 0.0), 0.01))
            continue
        for o in engine.step():
            if o.finished:
                out_tokens += len(o.outputs[0].token_ids)
                if timed:
                    ttft.append(o.trace["ttft_s"])
                if request_traces is not None:
                    request_traces.append(dict(o.trace, request_id=o.request_id, policy=name or policy))
    elapsed = time.monotonic() - t0
    tr = engine.trace
    pool = engine.block_manager.num_blocks * plan.engine.block_size
    fill = [t.kv_used_slots / t.kv_allocated_slots for t in tr if t.kv_allocated_slots]
    occ = [t.kv_used_slots / pool for t in tr]
    padding = defaultdict(lambda: [0, 0, 0])
    for t in tr:
        p = padding[f"{t.bucket[0]}x{t.bucket[1]}"]
        p[0] += 1
        p[1] += t.num_tokens
        p[2] += t.bucket[0]
    timeline, window = [], 1.0
    if tr:
        start = t0
        by_bin = defaultdict(int)
        for t in tr:
            by_bin[int((t.time - start) / window)] += t.num_sampled
        for t in tr:
            timeline.append((t.time - start, by_bin[int((t.time - start) / window)] / window,
                             t.kv_used_slots / pool))
    return RunResult(name or policy, elapsed, sum(len(p) for p, _ in work), out_tokens,
                     float(np.mean(fill)) if fill else 0.0, max(fill, default=0.0),
                     float(np.mean(occ)) if occ else 0.0, max(occ, default=0.0),
                     engine.num_recompiles, len(tr), dict(padding),
                     step_breakdown(tr), timeline, _spec_counts(engine), ttft, schedule_digest(tr))


def schedule_digest(trace) -> str:
    """What the steps ran, not how long they took: equal digests mean one identical schedule."""
    steps = [(tuple(t.bucket), t.num_tokens, t.num_sampled) for t in trace]
    return hashlib.sha256(repr(steps).encode()).hexdigest()[:16] if steps else ""


def _spec_counts(engine) -> tuple[int, int, int] | None:
    if engine.speculative is None:
        return None
    st = engine.stats()
    return st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens


STEP_PARTS = ("schedule", "prepare", "dispatch", "device", "postprocess")


def step_breakdown(trace) -> dict:
    """Median ms per step of each part of the engine step, the host total, and its share."""
    if not trace:
        return {}
    out = {p: float(np.median([getattr(t, f"{p}_s") for t in trace])) * 1e3 for p in STEP_PARTS}
    host = np.array([t.host_s for t in trace])
    total = host + np.array([t.device_s for t in trace])
    out["host"] = float(np.median(host)) * 1e3
    out["host_share"] = float(np.median(host / total))
    # Async scheduling hides a step's launch (schedule, prepare, dispatch) behind the step before
    # it, and its postprocess behind the step after it, when that one was launched first.
    over = [t.overlapped for t in trace]
    exposed = [(0.0 if t.overlapped else t.schedule_s + t.prepare_s + t.dispatch_s)
               + (0.0 if i + 1 < len(trace) and over[i + 1] else t.postprocess_s) for i, t in enumerate(trace)]
    out["host_exposed"] = float(np.median(exposed)) * 1e3
    out["overlapped_share"] = float(np.mean(over))
    return out


def hf_model(config, weights):
    """The same weights as an HF transformers LlamaForCausalLM in f32 (the baseline's model)."""
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.weights import save_safetensors

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as d:
        hf_cfg = LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_q_heads, num_key_value_heads=config.num_kv_heads,
            head_dim=config.head_dim, rope_theta=config.rope_theta, rms_norm_eps=config.rms_eps,
            tie_word_embeddings=config.tie_embeddings, max_position_embeddings=config.max_position_embeddings,
            attention_bias=config.qkv_bias)
        hf_cfg.save_pretrained(d)
        save_safetensors(weights, f"{d}/model.safetensors")
        return LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()


def run_hf(config, weights, work, batch_size: int) -> RunResult:
    """HF transformers `generate()` with static left-padded batches: the usual baseline."""
    import torch

    model = hf_model(config, weights)
    pad = 0
    t0 = time.monotonic()
    out_tokens = 0
    with torch.no_grad():
        for i in range(0, len(work), batch_size):
            batch = work[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for j, (p, _) in enumerate(batch):
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            max_new = max(m for _, m in batch)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False, pad_token_id=pad)
            out_tokens += sum(m for _, m in batch)  # only the tokens each request asked for count
    elapsed = time.monotonic() - t0
    return RunResult("hf-transformers", elapsed, sum(len(p) for p, _ in work), out_tokens,
                     0, 0, 0, 0)


def report(results: list[RunResult], out=sys.stdout) -> None:
    print(f"{'run':<16}{'time s':>8}{'out tok/s':>11}{'total tok/s':>13}{'KV fill mean/peak':>20}"
          f"{'KV pool peak':>14}{'steps':>7}{'recomp':>8}{'host/dev ms':>15}", file=out)
    for r in results:
        fill = f"{r.kv_fill_mean:.0%}/{r.kv_fill_peak:.0%}" if r.num_steps else "-"
        pool = f"{r.kv_pool_peak:.0%}" if r.num_steps else "-"
        prof = f"{r.breakdown_ms['host']:.1f}/{r.breakdown_ms['device']:.0f}" if r.num_steps else "-"
        print(f"{r.name:<16}{r.elapsed_s:>8.1f}{r.output_tps:>11.1f}{r.total_tps:>13.1f}{fill:>20}"
              f"{pool:>14}{r.num_steps:>7}{r.recompiles:>8}{prof:>15}", file=out)
    for r in results:
        if r.breakdown_ms:
            b = r.breakdown_ms
            print(f"step breakdown ({r.name}, median ms): " + ", ".join(f"{p} {b[p]:.2f}" for p in STEP_PARTS)
                  + f"; host {b['host']:.2f} = {b['host_share']:.0%} of the step, {b['host_exposed']:.2f} not "
                  f"hidden behind the device ({b['overlapped_share']:.0%} of steps launched while the one "
                  f"before ran: async scheduling)", file=out)
    for r in results:
        if r.spec is not None:
            drafts, drafted, accepted = r.spec
            rate = f"{accepted / drafted:.1%}" if drafted else "-"
            mean = f"{1 + accepted / drafts:.2f}" if drafts else "-"
            print(f"speculative decoding ({r.name}): {drafts} drafts of {drafted} tokens, {accepted} accepted "
                  f"({rate}); mean acceptance length {mean} tokens per verified sequence step "
                  f"(the speed-up against plain decoding: benchmarks/bench_spec_decode.py)", file=out)
    for r in results:
        if r.ttft_s:
            t = np.asarray(r.ttft_s)
            print(f"TTFT ({r.name}, {len(t)} requests arriving at the rate): p50 {np.median(t):.2f} s, "
                  f"p90 {np.percentile(t, 90):.2f} s, p99 {np.percentile(t, 99):.2f} s, max {t.max():.2f} s", file=out)
    by_name = {r.name: r for r in results}
    for r in results:
        base = by_name.get(r.name.split("+json")[0]) if "+json" in r.name else None
        if base is not None:
            print(f"structured outputs ({r.name}): {r.output_tps:.1f} out tok/s against {base.output_tps:.1f} free, "
                  f"cost {100 * (1 - r.output_tps / base.output_tps):+.1f}% ({r.output_tokens} and "
                  f"{base.output_tokens} tokens)", file=out)
    for r in results:
        if not r.padding:
            continue
        print(f"padding waste per bucket ({r.name}):", file=out)
        for b, (steps, real, padded) in sorted(r.padding.items(), key=lambda kv: [int(x) for x in kv[0].split("x")]):
            print(f"  {b:>9}: {steps:>4} steps, {real:>6} tokens in {padded:>6} slots, "
                  f"waste {1 - real / padded:.0%}", file=out)
    same = [(a, b) for i, a in enumerate(results) for b in results[i + 1:] if a.schedule and a.schedule == b.schedule]
    for a, b in same:
        print(f"{a.name} and {b.name} ran one identical schedule ({a.num_steps} steps): their throughputs differ "
              "only by noise (static and dynamic batching differ when requests arrive over time: --request-rate; "
              "continuous differs when there are more requests than --max-num-seqs)", file=out)
    base = {r.name: r for r in results}
    if "continuous" in base:
        c = base["continuous"]
        for other in ("static", "dynamic", "hf-transformers"):
            if other in base and not (c.schedule and c.schedule == base[other].schedule):
                print(f"continuous / {other} output throughput: {c.output_tps / base[other].output_tps:.2f}x",
                      file=out)


def plot(results: list[RunResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in results:
        if not r.timeline:
            continue
        t = [x[0] for x in r.timeline]
        a.plot(t, [x[1] for x in r.timeline], label=r.name)
        b.plot(t, [x[2] for x in r.timeline], label=r.name)
    a.set_ylabel("output tok/s (1 s bins)")
    b.set_ylabel("KV pool occupancy")
    b.set_xlabel("seconds")
    a.legend()
    a.set_title("throughput and KV utilization over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from runtime.errors import UserError

    if argv and argv[0] in ("serve", "soak"):  # against a running server
        import importlib

        import httpx

        online = importlib.import_module(f"runtime.tools.bench_{argv[0]}")
        try:
            return online.main(argv[1:])
        except httpx.ConnectError as e:
            raise UserError(f"cannot reach the server ({e}): start one with `jaxserve serve`, or point "
                            f"--url at it") from e
    from runtime.entrypoints.args import ArgumentParser, add_engine_args, engine_kwargs_from_args, preflight

    ap = ArgumentParser(prog="python -m runtime.bench", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--workload-seed", type=int, default=0)
    ap.add_argument("--baseline", choices=("hf",), default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None, help="write the results as JSON")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="write every request's trace (buckets, prefill chunks, prefix hits, queue time, "
                         "TTFT, per-token times) as JSON lines")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="write a jax.profiler trace of the timed runs to DIR (TensorBoard / Perfetto)")
    ap.add_argument("--request-rate", type=float, default=math.inf, metavar="RATE",
                    help="requests arrive at RATE per second (Poisson, seeded), as at a server but in process; "
                         "reports TTFT percentiles (default inf: all at once)")
    ap.add_argument("--structured-fraction", type=float, default=0.0, metavar="F",
                    help="also run each policy with this share of the requests constrained to a JSON schema "
                         "as long as their max_tokens, and report the throughput cost of the masks")
    add_engine_args(ap)
    args = ap.parse_args(argv)
    # --scheduling takes a comma list here: every policy runs on the same workload and plan.
    policies = [p for p in args.scheduling.split(",") if p]
    bad = [p for p in policies if p not in ("continuous", "dynamic", "static")]
    if bad or not policies:
        raise UserError(f"--scheduling {args.scheduling}: use a comma list of continuous, dynamic and static")
    if not 0.0 <= args.structured_fraction <= 1.0:
        raise UserError(f"--structured-fraction {args.structured_fraction}: a share between 0 and 1")
    if not args.request_rate > 0:
        raise UserError(f"--request-rate {args.request_rate}: requests per second, above 0 (inf: all at once)")
    if args.baseline == "hf":  # found out now, not after the JAX runs
        import importlib.util

        missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
        if missing:
            raise UserError(f"--baseline hf needs {' and '.join(missing)}: pip install -e '.[dev]' "
                            f"(or bash scripts/bootstrap.sh dev), or drop --baseline")
    kw = engine_kwargs_from_args(args)
    kw["scheduling"] = "continuous"
    if preflight(args, engine_kwargs=kw) is None:
        raise UserError(f"--model {args.model} is a plan directory; the offline benchmark compiles from a "
                        f"model (a preset, .gguf file or HF directory): pass that instead")

    from runtime.engine.plan import compile_plan
    from config.engine_config import EngineConfig
    from runtime.engine.build import build_runner
    from models.weights import load_model

    config, weights, tok = load_model(args.model)
    plan = compile_plan(None, EngineConfig.from_kwargs(**kw), weights=weights, config=config, tokenizer=tok)
    runner = build_runner(plan)
    warm = runner.warmup(progress=True, execute=True)
    print(f"warm-up (compile {len(plan.buckets.pairs())} buckets): {warm:.1f}s; "
          f"KV pool {plan.num_kv_blocks} blocks x {plan.engine.block_size}", file=sys.stderr)
    work = make_workload(args.workload, args.num_prompts, args.workload_seed, plan.engine.max_model_len,
                         config.vocab_size)
    print(f"workload {args.workload}: {len(work)} prompts, prompt tokens {sum(len(p) for p, _ in work)}, "
          f"output tokens {sum(m for _, m in work)}", file=sys.stderr)
    # A short untimed run so first-touch effects don't land on whichever policy runs first.
    run_engine(plan, runner, "continuous", work[:4], tok, structured_fraction=0.5 if args.structured_fraction else 0.0,
               schema_items=max(m for _, m in work))  # and the grammar's compile, when there is one
    results = []
    traces = [] if args.trace else None
    import contextlib

    import jax

    with jax.profiler.trace(args.profile) if args.profile else contextlib.nullcontext():
        for p in policies:
            runs = [(p, 0.0)] + ([(f"{p}+json", args.structured_fraction)] if args.structured_fraction else [])
            for name, fraction in runs:
                r = run_engine(plan, runner, p, work, tok, request_traces=traces, request_rate=args.request_rate,
                               structured_fraction=fraction, name=name)
                print(f"  {name}: {r.elapsed_s:.1f}s, {r.output_tps:.1f} out tok/s", file=sys.stderr)
                results.append(r)
    if args.profile:
        print(f"profiler trace written under {args.profile}", file=sys.stderr)
    if args.trace:
        with open(args.trace, "w") as f:
            f.writelines(json.dumps(t) + "\n" for t in traces)
        print(f"{len(traces)} request traces written to {args.trace}", file=sys.stderr)
    if args.baseline == "hf":
        results.append(run_hf(config, weights, work, batch_size=plan.engine.max_num_seqs))
    report(results)
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(dataclasses.asdict(r), output_tps=r.output_tps, total_tps=r.total_tps,
                            timeline=None) for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    from runtime.errors import run_main

    sys.exit(run_main(main))
