"""Cache-aware routing against round robin, on replicas behind the front (runtime/distributed/front.py).

    .venv/bin/python benchmarks/dp_router.py                       # SmolLM2, dp=2, 256 requests
    .venv/bin/python benchmarks/dp_router.py --num-prompts 64 --request-rate 2

For each policy, starts `python -m runtime.serve --data-parallel-size 2 --router-policy P`
afresh (cold prefix caches), sends `jaxserve bench serve`'s shared-prefix workload (8 long
system prompts shared by the users, arriving interleaved at random, Poisson arrivals) through the
front, reads the replicas' prefix-cache counters from their /metrics, then stops it with
SIGTERM. The KV pool is sized (--num-kv-blocks) so that one replica holds half the system
prompts with room for its running requests, not all of them: the cache pressure under which
where a prefix goes matters. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_policy(policy: str, args, log_dir: Path):
    from runtime.tools.bench_serve import run
    from runtime.distributed.replicas import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "runtime.serve", "--model", args.model, "--data-parallel-size", "2",
           "--router-policy", policy, "--port", str(port), "--replica-log-dir", str(log_dir / policy),
           "--max-model-len", "512", "--max-num-seqs", "16", "--max-num-batched-tokens", "128",
           "--num-kv-blocks", str(args.num_kv_blocks), "--log-stats-interval", "0"]
    if args.cache_dir:
        cmd += ["--compilation-cache-dir", args.cache_dir]
    log_path = log_dir / f"{policy}.log"
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        t0 = time.monotonic()
        while "serving on" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() - t0 > 1800:
                raise RuntimeError(log_path.read_text()[-2000:])
            time.sleep(1)
        replicas = re.findall(r"replica \d+: pid \d+ on (http://\S+?),", log_path.read_text())[:2]
        (res,) = run(f"http://127.0.0.1:{port}", request_rates=[args.request_rate], num_prompts=args.num_prompts,
                     seed=args.seed, workload="shared-prefix", model=args.model, num_warmups=0,
                     max_output_len=args.output_len, metrics_urls=replicas)
        return res
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=64, help="per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None, help="JAX's compilation cache for the replicas")
    ap.add_argument("--policies", default="cache_aware,round_robin")
    args = ap.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="dp-router-"))
    rows = []
    for policy in args.policies.split(","):
        r = run_policy(policy, args, log_dir)
        rows.append((policy, r))
        print(f"{policy}: hit rate {r.prefix_cache_hit_rate}, {r.completed}/{r.num_prompts} ok, "
              f"{r.request_throughput:.2f} req/s", file=sys.stderr, flush=True)
    print(f"{args.model}, dp=2 (one core each), {args.num_prompts} requests at {args.request_rate} req/s "
          f"(Poisson), shared-prefix workload (8 system prompts), {args.output_len} output tokens, "
          f"{args.num_kv_blocks} KV blocks per replica; load {os.getloadavg()[0]:.1f}; logs in {log_dir}\n")
    print("| policy | prefix cache hit rate | ok/sent | req/s | output tok/s | TTFT P50 (ms) | TTFT P99 (ms) |")
    print("|---|---|---|---|---|---|---|")
    for policy, r in rows:
        hit = f"{r.prefix_cache_hit_rate:.1%}" if r.prefix_cache_hit_rate is not None else "-"
        print(f"| {policy} | {hit} | {r.completed}/{r.num_prompts} | {r.request_throughput:.2f} | "
              f"{r.output_throughput:.1f} | {r.ttft_ms['median']:.0f} | {r.ttft_ms['p99']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
